"""The first GPU's probe of the TensorRT and onnxruntime-CUDA paths (issue 45): one JSON line per check.

Run by scripts/gpu_check.sh where torch sees a CUDA device; each check catches its own failure and says so in
its line, so one broken piece does not hide the others. Checks, in order (tiny random models, built here):

1. ``versions``: torch / CUDA / GPU, TensorRT (or why not), onnxruntime and its providers, the wheels installed
   (both onnxruntime wheels together, a TensorRT CUDA major other than torch's);
2. ``build``: tiny Llama, GPT-2 and T5 in fp32 and Llama in fp16, exported and built (refittable / folded
   counts, precision, build seconds; the int8 Q/DQ Llama too: whether TensorRT kept its int8 twins refittable);
3. ``align``: a raw ``set_tensor_address`` of an address 8 bytes off a 256-byte boundary (TensorRT should say no);
4. ``parity``: greedy tokens and the max log-prob difference against the ``torch`` engine at batch 1 and 3;
5. ``push``: a whole-model push right after an in-place update queued behind a long kernel on the learner's stream,
   compared with the reference holding the same tensors, and its time;
6. ``ort_cuda``: onnxruntime's CUDA provider on the fp32 Llama folder: parity and a whole-model push's phases.

``--stand-in`` runs the same checks on the CPU through tests/tensorrt_standin.py (a check of this script, not of
TensorRT). Usage: python scripts/gpu_probe.py [--work DIR] [--stand-in] [--only build,parity,...]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 17, 33, 8], [9, 4], [12, 60, 61, 70, 71, 3]]
BUILDS = [("tiny-llama", "fp32"), ("tiny-gpt2", "fp32"), ("tiny-t5", "fp32"), ("tiny-llama", "fp16")]
TOL = {"fp32": 1e-3, "fp16": 5e-2}  # tests/conftest.py ATOL["tensorrt"]


def emit(check: str, **row) -> dict:
    print(json.dumps({"check": check, **row}, default=str), flush=True)
    return row


def guarded(check: str, fn, *args):
    """``fn(*args)``; a failure becomes this check's line (``ok: false`` and the error's last line)."""
    t0 = time.perf_counter()
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - a probe reports every failure and goes on
        where = traceback.extract_tb(e.__traceback__)[-1]
        emit(check, ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
             at=f"{Path(where.filename).name}:{where.lineno}", seconds=round(time.perf_counter() - t0, 2))
        return None


class Env:
    """Where the probe builds, and which ``tensorrt`` it drives (the real one, or the stand-in with host buffers)."""

    def __init__(self, work: Path, stand_in: bool):
        self.work, self.fake = work, None
        self.device = "cuda"
        if stand_in:
            sys.path.insert(0, str(ROOT / "tests"))
            from tensorrt_standin import make_stand_in

            import refit.rollout.tensorrt.build as tb
            from refit.core.manifest_sections import TrtDevice

            self.fake, self.device = make_stand_in(), "cpu"
            tb.require_tensorrt = lambda: self.fake
            tb._device = lambda: TrtDevice(name="stand-in", compute_capability="0.0")
        self.models: dict[str, Path] = {}
        self.folders: dict[tuple, Path] = {}

    def model(self, arch: str) -> Path:
        if arch not in self.models:
            from refit.learner.builtin.models import build_model

            self.models[arch] = build_model(arch, self.work / "models" / arch, seed=0)
        return self.models[arch]

    def trt(self, folder: Path, **kw):
        from refit.rollout.tensorrt.engine import TrtEngine

        return TrtEngine(folder, device=self.device, **kw)


def check_versions(env: Env) -> dict:
    import platform

    from refit.export.graph import installed_distributions
    from refit.rollout.tensorrt.build import cuda_major_mismatch, tensorrt_unavailable_reason

    row = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    if row["gpu"]:
        row["capability"] = "%d.%d" % torch.cuda.get_device_capability(0)
    try:
        import onnxruntime as ort

        row.update(onnxruntime=ort.__version__, providers=ort.get_available_providers())
    except Exception as e:  # noqa: BLE001
        row["onnxruntime"] = f"missing ({type(e).__name__})"
    dists = installed_distributions()
    row["wheels"] = sorted(d for d in dists if d.startswith(("onnxruntime", "tensorrt", "nvidia-cuda-runtime")))
    row["tensorrt"] = env.fake.__version__ if env.fake else (tensorrt_unavailable_reason() or
                                                             __import__("tensorrt").__version__)
    row["cuda_major_mismatch"] = cuda_major_mismatch(dists=dists)
    return emit("versions", ok=True, **row)


def _export(env: Env, arch: str, dtype: str, quantize: str = "none") -> Path:
    """The ONNX export (its own parity gate on ONNX Runtime CPU), the TensorRT build left to the caller."""
    from refit.export.options import ExportOptions
    from refit.rollout.build import build

    opts = ExportOptions(dtype=dtype, max_batch=4, max_len=64, attention="plain", quantize=quantize,
                         **({"backend": "tensorrt"} if quantize != "none" else {}))
    out = env.work / "engines" / f"{arch}-{dtype}{'-' + quantize if quantize != 'none' else ''}"
    return build(env.model(arch), out, opts=opts, log=lambda *_: None)


def check_build(env: Env, arch: str, dtype: str, quantize: str = "none") -> dict:
    from refit.core.manifest import Manifest
    from refit.export.graph import foldable_weights
    from refit.rollout.tensorrt.build import build_engines, mapped_trt_names
    from refit.rollout.tensorrt.check_graph import load_graph

    t0 = time.perf_counter()
    d = _export(env, arch, dtype, quantize)
    build_engines(d, log=lambda *_: None, strict=False)  # record what TensorRT folded instead of stopping there
    m = Manifest.read(d)
    graphs = {g: {"refittable": len(r.refittable_weights), "mapped": len(mapped_trt_names(m, g)),
                  "not_refittable": list(r.not_refittable[:5]), "n_not_refittable": len(r.not_refittable),
                  "foldable_by_graph": len(foldable_weights(load_graph(d / m.graphs[g].file), mapped_trt_names(m, g))),
                  "precision": r.precision, "build_seconds": r.build_seconds, "plan_mib": round(r.plan_bytes / 2**20, 2)}
              for g, r in m.tensorrt.items()}
    ok = all(not v["n_not_refittable"] for v in graphs.values())
    env.folders[(arch, dtype, quantize)] = d
    return emit("build", ok=ok, arch=arch, dtype=dtype, quantize=quantize, graphs=graphs,
                export_and_build_seconds=round(time.perf_counter() - t0, 2))


def check_align(env: Env, folder: Path) -> dict:
    """TensorRT's answer to an address 8 bytes off its 256-byte rule, and to an aligned one, on a real context."""
    from refit.rollout.tensorrt.runner import aligned_empty

    eng = env.trt(folder)
    try:
        g = eng.graphs["decoder"]
        buf = aligned_empty((1024,), torch.int64, eng.device)
        name = g.inputs[0]
        off = bool(g.context.set_tensor_address(name, buf.data_ptr() + 8))
        on = bool(g.context.set_tensor_address(name, buf.data_ptr()))
    finally:
        eng.close()
    return emit("align", ok=on and not off, unaligned_accepted=off, aligned_accepted=on)


def _compare(eng, ref, prompts, sampling) -> dict:
    a, b = ref.generate(prompts, sampling), eng.generate(prompts, sampling)
    s_ref = ref.score(a.prompt_ids, a.prompt_mask, a.response_ids, a.response_mask).logprobs
    s_eng = eng.score(a.prompt_ids, a.prompt_mask, a.response_ids, a.response_mask).logprobs
    return {"tokens_equal": bool(torch.equal(a.response_ids, b.response_ids)),
            "max_logprob_diff": float((s_eng.cpu() - s_ref.cpu()).abs().max())}


def check_parity(env: Env, arch: str, dtype: str) -> dict:
    from refit.rollout.engine import create_engine
    from refit.rollout.types import SamplingParams

    sampling = SamplingParams(max_new_tokens=8, greedy=True)
    eng, ref = env.trt(env.folders[(arch, dtype, "none")]), create_engine("torch", env.model(arch))
    try:
        rows = {f"batch{len(p)}": _compare(eng, ref, p, sampling) for p in (PROMPTS[:1], PROMPTS)}
    finally:
        eng.close()
    ok = all(r["max_logprob_diff"] <= TOL[dtype] for r in rows.values()) and (
        dtype != "fp32" or all(r["tokens_equal"] for r in rows.values()))
    return emit("parity", ok=ok, arch=arch, dtype=dtype, tol=TOL[dtype], **rows)


def _learner_update(model, stream) -> dict:
    """Queue a long kernel, then an in-place update of every weight, on ``stream`` (the learner's); no sync."""
    from refit.export.weight_map import canonical_params

    params, _ = canonical_params(model)
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(1)
    with torch.cuda.stream(stream) if stream is not None else _null():
        if stream is not None:
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the update runs
        with torch.no_grad():
            for p in params.values():
                p.add_(0.05 * torch.randn(p.shape, generator=g, device=p.device))
    return params


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def check_push(env: Env, arch: str = "tiny-llama", kind: str = "tensorrt") -> dict:
    """A whole-model push right after an update queued on the learner's stream; then parity against the reference
    holding the same tensors (copied after the learner's stream is done)."""
    from refit.core.hf_folder import load_model
    from refit.rollout.engine import create_engine
    from refit.rollout.types import SamplingParams

    folder = env.folders[(arch, "fp32", "none")]
    cuda = env.device == "cuda"
    model = load_model(env.model(arch)).to(env.device)
    stream = torch.cuda.Stream() if cuda else None
    eng = env.trt(folder) if kind == "tensorrt" else create_engine("onnxruntime", folder, device="cuda" if cuda else "cpu")
    ref = create_engine("torch", env.model(arch))
    try:
        params = _learner_update(model, stream)
        t0 = time.perf_counter()
        with torch.cuda.stream(stream) if cuda else _null():
            eng.update_weights(params)  # the learner's stream is current: the engine must wait for it
        push_s = time.perf_counter() - t0
        if cuda:
            torch.cuda.synchronize()
        ref.update_weights({n: p.detach().cpu() for n, p in params.items()})
        row = _compare(eng, ref, PROMPTS, SamplingParams(max_new_tokens=8, greedy=True))
        phases = {k: round(v, 4) for k, v in getattr(eng, "last_push_s", {}).items()}
    finally:
        eng.close()
    ok = row["tokens_equal"] and row["max_logprob_diff"] <= TOL["fp32"]
    return emit("push" if kind == "tensorrt" else "ort_cuda_push", ok=ok, arch=arch, push_seconds=round(push_s, 4),
                phases=phases, **row)


def check_ort_cuda(env: Env, arch: str = "tiny-llama") -> dict:
    from refit.rollout.engine import create_engine
    from refit.rollout.types import SamplingParams

    folder = env.folders[(arch, "fp32", "none")]
    eng = create_engine("onnxruntime", folder, device="cuda" if env.device == "cuda" else "cpu")
    ref = create_engine("torch", env.model(arch))
    try:
        providers = eng.sessions["decoder"].get_providers()
        rows = {f"batch{len(p)}": _compare(eng, ref, p, SamplingParams(max_new_tokens=8, greedy=True))
                for p in (PROMPTS[:1], PROMPTS)}
    finally:
        eng.close()
    ok = all(r["max_logprob_diff"] <= TOL["fp32"] and r["tokens_equal"] for r in rows.values())
    return emit("ort_cuda", ok=ok, arch=arch, providers=providers, **rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default=None, help="folder for the tiny models and engines (default: a temp folder)")
    p.add_argument("--stand-in", action="store_true", help="the CPU stand-in of TensorRT (checks this script)")
    p.add_argument("--only", default="versions,build,align,parity,push,ort_cuda", help="checks to run, comma-separated")
    a = p.parse_args(argv)
    only = set(a.only.split(","))
    env = Env(Path(a.work or tempfile.mkdtemp(prefix="refit_gpu_probe_")), a.stand_in)
    t0 = time.perf_counter()
    results = []
    if "versions" in only:
        results.append(guarded("versions", check_versions, env))
    if not a.stand_in and not torch.cuda.is_available():
        emit("gpu", ok=True, skipped="no CUDA device visible to torch")
        return 0
    if "build" in only:
        for arch, dtype in BUILDS:
            results.append(guarded("build", check_build, env, arch, dtype))
        results.append(guarded("build", check_build, env, "tiny-llama", "fp32", "int8"))
    have = {k[:2] for k in env.folders if k[2] == "none"}
    if "align" in only and ("tiny-llama", "fp32") in have:
        results.append(guarded("align", check_align, env, env.folders[("tiny-llama", "fp32", "none")]))
    if "parity" in only:
        results += [guarded("parity", check_parity, env, *k) for k in BUILDS if k in have]
    if "push" in only and ("tiny-llama", "fp32") in have:
        results.append(guarded("push", check_push, env))
    ort_ok = a.stand_in or "CUDAExecutionProvider" in (results[0] or {}).get("providers", [])
    if "ort_cuda" in only and ("tiny-llama", "fp32") in have and ort_ok:
        results.append(guarded("ort_cuda", check_ort_cuda, env))
        results.append(guarded("ort_cuda_push", check_push, env, "tiny-llama", "onnxruntime"))
    elif "ort_cuda" in only:
        emit("ort_cuda", ok=False, skipped="no CUDAExecutionProvider (or no fp32 Llama folder)")
    failed = sum(1 for r in results if not (r or {}).get("ok"))
    emit("summary", ok=failed == 0, checks=len(results), failed=failed, seconds=round(time.perf_counter() - t0, 1),
         work=str(env.work))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
