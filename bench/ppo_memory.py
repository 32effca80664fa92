"""Peak memory of one PPO step at a large vocabulary, per learner variant, each in its own process.

``python -m refit.bench.ppo_memory --source /path/to/old/checkout --source .`` builds a 2-layer policy at
Qwen2.5-0.5B's widths and vocabulary (hidden 896, 14 heads, 2 KV heads, intermediate 4864, vocab 151936,
tied, qkv bias), exports it once (plain attention), then runs one PPO step (engine rollout, the
reference on the ONNX Runtime engine: ``score(topk=V)``, the learner's scoring forward, the update)
in a fresh process per ``--source`` checkout and per KL setting. Reported per variant: RSS after setup
(models, engines, optimizer) and the process's peak RSS, whose difference is what the step itself
adds: (B, T, V) logits, log-softmax temporaries, gradients. The last line is one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

_CHILD = """
import json, resource, sys, time
from pathlib import Path
import torch
torch.set_num_threads(2)
from refit.learner.ppo.config import PPOConfig
from refit.learner.ppo.cycle import setup, train_step
model, engine, work, batch, resp, est, pen = sys.argv[1:8]
prompts = Path(work) / "prompts.txt"
prompts.write_text("\\n".join(f"{i}+{i}=" for i in range(4 * int(batch))) + "\\n")
cfg = PPOConfig.from_flat(model_dir=model, engine_dir=engine, output_dir=str(Path(work) / "run"), backend="onnxruntime",
    prompts_file=str(prompts), reward="refit.bench.ppo:length_reward", steps=1, batch_size=int(batch), num_generations=1,
    response_length=int(resp), num_ppo_epochs=1, num_mini_batches=1, progress=False,
    tensorboard=False, plots=False, save_steps=1000, kl_estimator=est, kl_penalty=pen)
run = setup(cfg, resume=False, log=lambda *_: None)
def status(key):
    return int([l for l in open("/proc/self/status") if l.startswith(key + ":")][0].split()[1]) // 1024
before = status("VmRSS")
t = time.perf_counter()
m = train_step(run, 1, log=lambda *_: None)
s = time.perf_counter() - t
print(json.dumps({"rss_after_setup_mb": before, "peak_rss_mb": status("VmHWM"), "step_seconds": round(s, 1),
                  "kl_exact": m.get("kl/exact"), "kl_k1": m.get("kl/k1")}))
"""


def build(work: Path, layers: int) -> tuple[Path, Path]:
    """The checkpoint and its engine folder (reused when present)."""
    model, engine = work / "model", work / "engine"
    if not (model / "config.json").exists():
        import torch
        import transformers

        from refit.learner.examples.models import _IDS, build_tokenizer

        cfg = transformers.Qwen2Config(hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
                                       intermediate_size=4864, num_hidden_layers=layers, vocab_size=151936,
                                       tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=32768,
                                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **_IDS)
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(str(model))
        build_tokenizer(model)
    if not (engine / "manifest.json").exists():
        from refit.export.onnx_export import ExportOptions, export_onnx

        export_onnx(model, engine, ExportOptions(attention="plain", max_len=256), log=lambda *_: None)
    return model, engine


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m refit.bench.ppo_memory", description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=Path("runs/ppo_memory"))
    p.add_argument("--source", type=Path, action="append", help="checkout(s) whose learner is measured (default: this)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--response", type=int, default=64)
    p.add_argument("--kl", nargs="+", default=["exact:reward"], help="kl_estimator:kl_penalty settings to run")
    p.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    work = a.work.resolve()
    if a.build_only:
        build(work, a.layers)
        return 0
    if not (work / "engine" / "manifest.json").exists():  # in a child: the driver stays small while steps run
        subprocess.run([sys.executable, "-m", "refit.bench.ppo_memory", "--work", str(work), "--layers", str(a.layers),
                        "--build-only"], check=True)
    rows = []
    for src in [s.resolve() for s in (a.source or [Path(__file__).resolve().parents[1]])]:
        for kl in a.kl:
            est, pen = kl.split(":")
            run_dir = work / f"run-{len(rows)}"
            run_dir.mkdir(parents=True, exist_ok=True)
            r = subprocess.run([sys.executable, "-c", _CHILD, str(work / "model"), str(work / "engine"), str(run_dir),
                                str(a.batch), str(a.response), est, pen], cwd=src,
                               env={**os.environ, "PYTHONPATH": str(src)}, capture_output=True, text=True)
            row = {"source": str(src), "kl_estimator": est, "kl_penalty": pen}
            if r.returncode:
                row["error"] = (r.stderr.strip().splitlines() or ["?"])[-1][:300]
            else:
                row.update(json.loads(r.stdout.strip().splitlines()[-1]))
                row["step_adds_mb"] = row["peak_rss_mb"] - row["rss_after_setup_mb"]
            print(json.dumps(row), flush=True)
            rows.append(row)
    print(json.dumps({"bench": "ppo_memory", "vocab": 151936, "layers": a.layers, "batch": a.batch,
                      "response_length": a.response, "rows": rows,
                      "driver_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
