"""Peak memory of one PPO step at a large vocabulary, per learner variant, each in its own process.

``python -m refit.bench.ppo_memory --source /path/to/old/checkout --source .`` builds a 2-layer policy at
Qwen2.5-0.5B's widths and vocabulary (hidden 896, 14 heads, 2 KV heads, intermediate 4864, vocab 151936,
tied, qkv bias), exports it once (plain attention), then runs one PPO step (engine rollout, the
reference on the ONNX Runtime engine: ``score(topk=V)``, the learner's scoring forward, the update)
in a fresh process per ``--source`` checkout and per KL setting. Reported per variant: RSS after setup
(models, engines) and the process's peak RSS over step 1 (which also allocates the gradients and Adam's
state), then step 2's own peak over its starting RSS (the high-water mark reset between the steps):
(B, T, V) logits, log-softmax temporaries, logits gradient, the weight push. The last line is one JSON
document.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

from refit.export.options import ExportOptions
from refit.learner.builtin.models import _IDS, build_tokenizer
from refit.rollout.build import build as build_engine

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
    prompts_file=str(prompts), reward="refit.bench.ppo:length_reward", steps=2, batch_size=int(batch), num_generations=1,
    response_length=int(resp), num_ppo_epochs=1, num_mini_batches=1, progress=False,
    tensorboard=False, plots=False, save_steps=1000, kl_estimator=est, kl_penalty=pen)
run = setup(cfg, resume=False, log=lambda *_: None)
def status(key):
    return int([l for l in open("/proc/self/status") if l.startswith(key + ":")][0].split()[1]) // 1024
before = status("VmRSS")
t = time.perf_counter()
m = train_step(run, 1, log=lambda *_: None)
s = time.perf_counter() - t
row = {"rss_after_setup_mb": before, "peak_rss_mb": status("VmHWM"), "step_seconds": round(s, 1),
       "kl_exact": m.get("kl/exact"), "kl_k1": m.get("kl/k1")}
# step 2 alone: the optimizer state and gradients exist already; the high-water mark is reset to the
# current RSS (Linux clear_refs 5), so its peak is this step's own
open("/proc/self/clear_refs", "w").write("5")
row["rss_before_step2_mb"] = status("VmRSS")
m = train_step(run, 2, log=lambda *_: None)
row["step2_peak_rss_mb"] = status("VmHWM")
row["step2_adds_mb"] = row["step2_peak_rss_mb"] - row["rss_before_step2_mb"]
print(json.dumps(row))
"""


# The learner's part alone (no engine: ONNX Runtime's backend keeps freed heap memory process-wide, which
# blurs RSS): score_batch with a PyTorch reference + exact KL, then the single-pass PPO update with the exact
# KL in the loss, on a random (B, Tp + Tr) batch, fp32.
_LEARNER = """
import json, sys, time, types
import torch
torch.set_num_threads(2)
from transformers import AutoModelForCausalLM
from refit.learner.ppo.experience import score_batch
from refit.learner.ppo.update import Experience, UpdateSettings, policy_forward, ppo_update
from refit.learner.run.policy import ValueHead, hidden_size
model_dir, b, tr, device = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), torch.device(sys.argv[4])
pol = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").to(device)
ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").to(device).eval()
vh = ValueHead(hidden_size(pol)).to(device)
g = torch.Generator().manual_seed(0)
v = pol.config.vocab_size
batch = types.SimpleNamespace(prompt_ids=torch.randint(4, v, (b, 16), generator=g).to(device),
    prompt_mask=torch.ones(b, 16, dtype=torch.long, device=device), response_ids=torch.randint(4, v, (b, tr), generator=g).to(device),
    response_mask=torch.ones(b, tr, device=device), is_seq2seq=False, num_rows=b,
    sampling=types.SimpleNamespace(temperature=1.0))
cuda = device.type == "cuda"
if cuda:
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
cuda_before = torch.cuda.memory_allocated() if cuda else 0
t0 = time.perf_counter()
s = UpdateSettings(1, 1, 1, 0.2, 0.2, 0.1, 0.01, 1.0, kl_coef=0.05, kl_in_loss=True, kl_estimator="exact")
opt = torch.optim.SGD(list(pol.parameters()) + list(vh.parameters()), lr=1e-6)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
def status(key):
    return int([l for l in open("/proc/self/status") if l.startswith(key + ":")][0].split()[1]) // 1024
before = status("VmRSS")
fwd = policy_forward(pol, vh, batch, s)
sc = score_batch(pol, vh, ref, batch, policy_out=fwd)
exp = Experience(batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask, sc.logprobs, sc.ref_logprobs,
                 sc.values, torch.randn(b, tr, generator=g).to(device), torch.zeros(b, tr, device=device), None, 1.0)
st = ppo_update(pol, vh, opt, sched, exp, s, torch.Generator().manual_seed(1), ref_model=ref, forward=fwd)
if cuda:
    torch.cuda.synchronize()
row = {"device": str(device), "seconds": round(time.perf_counter() - t0, 3), "rss_before_mb": before,
       "peak_rss_mb": status("VmHWM"), "learner_adds_mb": status("VmHWM") - before,
       "kl_exact_min": float(sc.exact_kl.min()), "kl_exact_max": float(sc.exact_kl.max()), "kl_loss": st.get("kl_loss")}
if cuda:  # the CUDA caching allocator's high-water mark over score + update, above the models' own memory
    row.update(cuda_name=torch.cuda.get_device_name(), cuda_before_mb=cuda_before >> 20,
               cuda_peak_mb=torch.cuda.max_memory_allocated() >> 20,
               cuda_adds_mb=(torch.cuda.max_memory_allocated() - cuda_before) >> 20)
print(json.dumps(row))
"""


def build(work: Path, layers: int, with_engine: bool = True) -> tuple[Path, Path]:
    """The checkpoint and (``with_engine``) its engine folder, reused when present."""
    model, engine = work / "model", work / "engine"
    if not (model / "config.json").exists():
        import torch
        import transformers

        cfg = transformers.Qwen2Config(hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
                                       intermediate_size=4864, num_hidden_layers=layers, vocab_size=151936,
                                       tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=32768,
                                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **_IDS)
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(str(model))
        build_tokenizer(model)
    if with_engine and not (engine / "manifest.json").exists():
        build_engine(model, engine, opts=ExportOptions(attention="plain", max_len=256), log=lambda *_: None)
    return model, engine


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m refit.bench.ppo_memory", description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=Path("runs/ppo_memory"))
    p.add_argument("--source", type=Path, action="append", help="checkout(s) whose learner is measured (default: this)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--response", type=int, default=64)
    p.add_argument("--kl", nargs="+", default=["exact:reward"], help="kl_estimator:kl_penalty settings to run")
    p.add_argument("--learner-only", action="store_true", help="measure the learner's score + update alone, "
                   "PyTorch reference, no engine")
    p.add_argument("--device", default="cpu", help="the learner's device for --learner-only (cpu, cuda)")
    p.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    work = a.work.resolve()
    if a.build_only:
        build(work, a.layers, with_engine=not a.learner_only)
        return 0
    done = work / "model" / "config.json" if a.learner_only else work / "engine" / "manifest.json"
    if not done.exists():  # in a child: the driver stays small while steps run
        subprocess.run([sys.executable, "-m", "refit.bench.ppo_memory", "--work", str(work), "--layers", str(a.layers),
                        "--build-only"] + (["--learner-only"] if a.learner_only else []), check=True)
    rows = []
    if a.learner_only:
        for src in [s.resolve() for s in (a.source or [Path(__file__).resolve().parents[2]])]:
            r = subprocess.run([sys.executable, "-c", _LEARNER, str(work / "model"), str(a.batch), str(a.response),
                                a.device],
                               cwd=src, env={**os.environ, "PYTHONPATH": str(src)}, capture_output=True, text=True)
            row = {"source": str(src), "part": "learner (score_batch + single-pass update, exact KL in reward and loss)"}
            row.update(json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0
                       else {"error": (r.stderr.strip().splitlines() or ["?"])[-1][:300]})
            print(json.dumps(row), flush=True)
            rows.append(row)
        a.kl = []
    for src in [s.resolve() for s in (a.source or [Path(__file__).resolve().parents[2]])]:
        for kl in a.kl:  # noqa: B007
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
    print(json.dumps({"bench": "ppo_memory", "vocab": 151936, "device": a.device if a.learner_only else "cpu", "layers": a.layers, "batch": a.batch,
                      "response_length": a.response, "rows": rows,
                      "driver_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
