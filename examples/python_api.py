"""Refit from Python: a model folder -> a parity-gated engine -> generation -> a few PPO steps with a reward
written as a plain Python function. Runs on a CPU in about a minute; nothing is downloaded.

    python examples/python_api.py [OUT_DIR]          # default: runs/python-api
"""

import sys
from pathlib import Path

import refit
from refit.learner.builtin.models import build_model
from refit.learner.run.config import LogSection, ModelSection, OptimSection, RunSection

out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/python-api")

# 1. an HF checkpoint folder (here a tiny random GPT-2 with a locally trained tokenizer; any causal-LM folder works)
model_dir = build_model("tiny-gpt2", out / "model", seed=0)

# 2. export it: ONNX graphs with a KV cache, the HF -> engine weight map, a parity gate against PyTorch
engine_dir = refit.build_engine(model_dir, out / "engine", opts=refit.ExportOptions(max_batch=16, max_len=128))
print("parity:", refit.Manifest.read(engine_dir).parity.max_abs_logprob_diff)

# 3. generate: token ids in, tokens + masks + the engine's own per-token log-probs out
engine = refit.create_engine("onnxruntime", engine_dir)
batch = engine.generate([[5, 6, 7], [8, 9]], refit.SamplingParams(max_new_tokens=8, top_k=20, seed=0))
print("response ids:", batch.response_ids.tolist(), "log-probs:", batch.rollout_logprobs.shape)
engine.close()


# 4. PPO-KL (GRPO advantages) with a reward function in TRL's signature: fn(prompts, completions, **columns)
def short_answers(prompts, completions, **kwargs):
    return [1.0 / (1 + len(c)) for c in completions]


cfg = refit.PPOConfig(run=RunSection(output_dir=str(out / "run"), steps=3, batch_size=4),
                      model=ModelSection(model_dir=str(model_dir), engine_dir=str(engine_dir)),
                      optim=OptimSection(learning_rate=1e-3), log=LogSection(progress=False, plots=False),
                      advantage_estimator="grpo", num_generations=4, response_length=8, export_final=False)
result = refit.run_ppo(cfg, reward_funcs=[short_answers])
print("steps:", [m["step"] for m in result.metrics if "reward/mean" in m],
      "KL at step 1 (policy == reference):", result.metrics[0]["kl/exact"] if result.metrics else None)
print(result.summary)
