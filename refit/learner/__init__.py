"""The PyTorch side: pure losses, the PPO and distillation jobs, what they share, the builtin tasks and models."""
