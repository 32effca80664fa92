"""Mixture-of-experts at published widths: ``python -m refit.bench.moe [--only NAME ...] [--compare]``.

For Mixtral-8x7B's and Qwen3-30B-A3B's geometry (refit/learner/builtin/moe_models.py), cut as :data:`RUNS` says
(published widths and vocabulary, fewer experts, 1 layer) to fit the shared 24 GB box, each stage in a fresh process (its
peak RSS is its own): build the checkpoint, export it through the parity gate (seconds, peak RSS,
parity, attention), push perturbed expert weights into the ONNX Runtime engine (the output moves,
and matches the PyTorch engine holding the same weights), then two PPO steps (KL(0), the step-2
exact KL). ``--compare`` also times the experts lowering chosen in refit/export/moe.py against a dense
"every expert, masked" forward on the same model (ONNX Runtime, no cache, prefill and one-token
batches, median of 5 runs) with each one's max |dlogit| against PyTorch. The last stdout line is
one JSON document.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

from refit.bench.smokes import distill_smoke, ppo_smoke
from refit.core.manifest import Manifest
from refit.export.moe import translation_table, use_grouped_experts
from refit.export.options import ExportOptions
from refit.learner.builtin.models import build_tokenizer
from refit.learner.builtin.moe_models import build_moe_model
from refit.rollout.build import build
from refit.rollout.ort_backend import OrtEngine
from refit.rollout.torch_backend import TorchEngine
from refit.rollout.types import SamplingParams

# what is cut from the published geometry, and why (fp32). Widths, heads, head dims, routing and vocabulary are the
# published ones; the expert count (and depth) is what the shared 24 GB box forces down. A PPO step holds the
# policy, its gradient, two Adam moments and one engine session each for the policy and the reference (~6x the
# model in fp32), so a row must stay near 3 GB of weights:
RUNS = {
    # one Mixtral expert is 176M parameters (0.7 GB). Kept: hidden 4096, 32/8 heads (head_dim 128), expert width
    # 14336, top-2 routing, rope theta 1e6. Cut: 1 layer, 8 -> 4 experts (top-2 of 4 still selects), vocabulary
    # 32000 -> the local tokenizer's 384 (the untied embedding + head would add 262M); 750M parameters.
    "mixtral-8x7b": dict(num_hidden_layers=1, num_experts=4, vocab_size=None),
    # the same with 2 experts (top-2 of 2: both always routed, the router's weights still trained): measured, the
    # 4-expert PPO step was OOM-killed on this box (its two 3-D expert tensors are 470M and 235M parameters, and
    # AdamW's temporaries are per tensor); 397M parameters.
    "mixtral-8x7b-2-experts": dict(geometry="mixtral-8x7b", num_hidden_layers=1, num_experts=2, vocab_size=None),
    # Kept: hidden 2048, 32/4 heads, head_dim 128, q/k norm, expert width 768, top-8 (renormalised), rope theta 1e6,
    # untied vocabulary 151936 (622M of the parameters). Cut: 1 layer, 128 -> 16 experts (128 are 604M parameters
    # a layer); 717M parameters.
    "qwen3-30b-a3b": dict(num_hidden_layers=1, num_experts=16),
    # the same with the vocabulary cut to the local tokenizer's 384: measured, the PPO step above was OOM-killed on
    # this box (the untied 151936-row embedding and head are 622M of its 717M parameters); 95M parameters.
    "qwen3-30b-a3b-small-vocab": dict(geometry="qwen3-30b-a3b", num_hidden_layers=1, num_experts=16, vocab_size=None),
}


def _peak_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _in_child(fn, *args):
    """``fn(*args)`` in a fresh process: (its result, its peak RSS in MB)."""
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        return pool.submit(_measured, fn, *args).result()


def _measured(fn, *args):
    return fn(*args), _peak_mb()


def build_stage(name: str, out: str) -> dict:
    cut = dict(RUNS[name])
    build_moe_model(cut.pop("geometry", name), out, build_tokenizer(), seed=0, **cut)
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(out)
    return {"config": {k: getattr(cfg, k, None) for k in (
        "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "intermediate_size", "moe_intermediate_size", "num_local_experts", "num_experts", "num_experts_per_tok",
        "vocab_size")}}


def export_stage(model_dir: str, engine_dir: str) -> dict:
    t0 = time.perf_counter()
    build(model_dir, engine_dir, opts=ExportOptions(max_batch=16, max_len=128), log=lambda *_: None)
    m = Manifest.read(engine_dir)
    return {"export_s": round(time.perf_counter() - t0, 1), "parity": m.parity.max_abs_logprob_diff,
            "attention": m.attention, "attention_reason": m.attention_reason,
            "expert_transforms": sorted({t.transform for k, v in m.weight_map.items() if ".experts." in k for t in v})}


def push_stage(model_dir: str, engine_dir: str) -> dict:
    """Perturb layer 0's expert tensors: the engine's log-probs move and match the PyTorch engine's."""
    import torch

    ort, ref = OrtEngine(engine_dir), TorchEngine(model_dir)
    tok_ids = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
    batch = ref.generate(tok_ids, SamplingParams(max_new_tokens=8, seed=0))

    def score(e):
        return e.score(batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask).logprobs

    before = score(ort)
    params = dict(ref.model.named_parameters())
    g = torch.Generator().manual_seed(1)
    named = {n: p.detach() + 0.05 * torch.randn(p.shape, generator=g) for n, p in params.items()
             if ".layers.0.mlp.experts." in n}
    ort.update_weights(named)
    ref.update_weights(named)
    after, want = score(ort), score(ref)
    return {"pushed": sorted(named), "moved": float((after - before).abs().max()),
            "max_abs_diff_vs_torch": float((after - want).abs().max())}


def ppo_stage(model_dir: str, engine_dir: str, root: str) -> dict:
    # push_via file: at these widths the memory route's push transient (~2x the model) would not fit the box
    return ppo_smoke({"model_dir": model_dir, "engine_dir": engine_dir}, Path(root), push_via="file")


def distill_stage(model_dir: str, engine_dir: str, root: str) -> dict:
    return distill_smoke({"model_dir": model_dir, "engine_dir": engine_dir}, Path(root), push_via="file")


def dense_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Every expert over every token, weighted by a (N, E) routing matrix that is 0 off the top-k (the alternative)."""
    import torch

    n = hidden_states.shape[0]
    w = torch.zeros(n, self.num_experts, dtype=hidden_states.dtype).scatter(1, top_k_index,
                                                                            top_k_weights.to(hidden_states.dtype))
    h = torch.einsum("nh,eih->eni", hidden_states, self.gate_up_proj)  # (E, N, 2I)
    h = self._apply_gate(h)  # (E, N, I)
    y = torch.einsum("eni,ehi->enh", h, self.down_proj)  # (E, N, H)
    return (y * w.t()[:, :, None]).sum(0)


def compare_stage(model_dir: str, work: str) -> dict:
    """Grouped (refit/export/moe.py) vs dense masked experts: ORT ms (median of 5) and max |dlogit| vs PyTorch."""
    import copy

    import numpy as np
    import onnxruntime as ort
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    class Logits(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, ids):
            return self.m(input_ids=ids, use_cache=False).logits

    ref = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ALL_EXPERTS_FUNCTIONS.register("refit_dense", dense_experts_forward)
    shapes = {"prefill 4x64": (4, 64), "one token 16x1": (16, 1)}
    out = {}
    for impl in ("grouped", "dense"):
        m = copy.deepcopy(ref)
        use_grouped_experts(m)
        if impl == "dense":
            m.set_experts_implementation("refit_dense")
        path = Path(work) / f"{impl}.onnx"
        ids = torch.randint(4, 300, (2, 5))
        with torch.no_grad():
            prog = torch.onnx.export(Logits(m).eval(), (ids,), input_names=["ids"], output_names=["logits"],
                                     dynamic_shapes={"ids": {0: torch.export.Dim("b"), 1: torch.export.Dim("t")}},
                                     dynamo=True, custom_translation_table=translation_table(), verbose=False)
        prog.save(str(path), external_data=True)
        del prog
        so = ort.SessionOptions()
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        rec = {}
        for label, (b, t) in shapes.items():
            x = torch.randint(4, 300, (b, t), generator=torch.Generator().manual_seed(b * t))
            with torch.no_grad():
                want = ref(input_ids=x).logits.numpy()
            got = sess.run(None, {"ids": x.numpy()})[0]
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                sess.run(None, {"ids": x.numpy()})
                times.append(time.perf_counter() - t0)
            rec[label] = {"ms": round(1e3 * statistics.median(times), 2),
                          "max_abs_dlogit": float(np.abs(got - want).max())}
        out[impl] = rec
        del sess
    out["dense_over_grouped"] = {k: round(out["dense"][k]["ms"] / out["grouped"][k]["ms"], 2) for k in shapes}
    return out


def run(name: str, root: Path, compare: bool) -> dict:
    model_dir, engine_dir = str(root / name / "model"), str(root / name / "engine")
    rec = {"geometry": name, "cut": RUNS[name]}
    for stage, fn, args in [("build", build_stage, (name, model_dir)),
                            ("export", export_stage, (model_dir, engine_dir)),
                            ("push", push_stage, (model_dir, engine_dir)),
                            ("ppo", ppo_stage, (model_dir, engine_dir, str(root / name / "ppo"))),
                            ("distill", distill_stage, (model_dir, engine_dir, str(root / name / "distill"))),
                            *([("compare", compare_stage, (model_dir, str(root / name)))] if compare else [])]:
        try:
            res, peak = _in_child(fn, *args)
            rec[stage] = {**res, "peak_rss_mb": peak}
        except Exception as e:  # noqa: BLE001 - a failed stage is a field of the record, not a traceback
            rec[stage] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        print(f"{name} {stage}: {json.dumps(rec[stage])}", flush=True)
        if isinstance(rec[stage], str):
            break  # the later stages need this one's output
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m refit.bench.moe", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="*", default=None, help=f"geometries (default all: {', '.join(RUNS)})")
    p.add_argument("--compare", action="store_true", help="also time grouped vs dense experts lowering")
    p.add_argument("--work-dir", default="", help="where checkpoints and engines go (default: a temp folder)")
    a = p.parse_args(argv)
    names = [n for n in RUNS if a.only is None or n in a.only]
    with tempfile.TemporaryDirectory(prefix="refit-moe-") as tmp:
        root = Path(a.work_dir) if a.work_dir else Path(tmp)
        records = [run(n, root, a.compare) for n in names]
    print(json.dumps(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
