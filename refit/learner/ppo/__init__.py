"""The PPO-KL job (GAE, RLOO, GRPO advantages): its config, cycle, update, rewards and data."""
