"""Engine folder (ONNX graphs + manifest) -> refittable TensorRT engines, one ``<graph>.plan`` each.

The Polygraphy chain ``EngineFromNetwork(NetworkFromOnnxPath(...))`` written out with the
TensorRT 10 Python API, plus what refit needs:

1. parse ``<graph>.onnx`` with ``trt.OnnxParser.parse_from_file`` (the path lets the parser find
   the external ``*.onnx.data`` weights next to it);
2. one ``IOptimizationProfile`` per manifest profile, in manifest order (``prefill``, ``decode``;
   ``encode`` for the T5 encoder), ``set_shape(input, min, opt, max)`` for every input;
3. ``BuilderFlag.REFIT`` (not ``REFIT_IDENTICAL``/``STRIP_PLAN``: those assume the refit weights
   equal the build weights, and RLHF pushes different ones every step); precision from the
   manifest dtype: ``FP16``/``BF16`` flags on TensorRT 10's weakly typed networks, TF32 off for
   fp32 so greedy tokens match ONNX Runtime; a strongly typed network where the precision flags
   are gone (TensorRT 11), the graph's own dtypes then decide;
4. ``build_serialized_network``, plan written atomically (temp file + ``os.replace``);
5. the plan is deserialized and ``trt.Refitter.get_all_weights()`` must list every engine weight
   of the weight map: a weight TensorRT constant-folded away would stay stale after a refit.

TensorRT's ONNX parser names refittable weights after the ONNX initializers
(``INetworkDefinition.setWeightsName``, see the TensorRT guide "Refitting an Engine"), so the
manifest's engine names are the refit names (:func:`trt_weight_name`).

A quantized folder (``--backend tensorrt --quantize int8``, refit/export/quantize.py's ``int8-qdq``: int8 weight
initializers through ``DequantizeLinear`` into fp32 matmuls) is built as a strongly typed network, as TensorRT 10's
guide asks of explicit quantization (no precision flags: INT8 is the weakly typed networks' switch), REFIT and
the profiles as always; its refittable names are the int8 twins and their scales (:func:`mapped_trt_names`), and
step 5 fails the build where TensorRT folded either into a constant it cannot refit.

``tensorrt`` is imported only inside these functions: the package imports without it.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import replace
from pathlib import Path

from refit.core.errors import RefitError
from refit.core.manifest import Manifest
from refit.core.manifest_sections import TrtDevice, TrtPlan, WeightTarget
from refit.export.graph import installed_distributions
from refit.export.quantize import QDQ

INSTALL_HINT = ("pip install refit[gpu] (CUDA 13 torch; refit[gpu-cu12] for CUDA 12) on an NVIDIA machine with a CUDA "
                "GPU, or use --backend onnxruntime")


def cuda_major_mismatch(torch_cuda: str | None = None, dists: set[str] | None = None) -> str | None:
    """None, or one line when the TensorRT wheels here are built for another CUDA major than torch's.

    The ``tensorrt`` metapackage picks ``tensorrt-cu12`` or ``tensorrt-cu13`` on its own; TensorRT then loads
    one CUDA runtime and torch another. ``torch_cuda``: ``torch.version.cuda`` (read when None); ``dists``: the
    installed distribution names (read when None, :func:`refit.export.graph.installed_distributions`)."""
    if torch_cuda is None:
        import torch

        torch_cuda = torch.version.cuda
    if not torch_cuda:
        return None
    if dists is None:
        dists = installed_distributions()
    majors = sorted(m for m in ("12", "13") if f"tensorrt-cu{m}" in dists or f"tensorrt-cu{m}-libs" in dists)
    want = torch_cuda.split(".")[0]
    if majors and want not in majors:
        return (f"TensorRT here is built for CUDA {'/'.join(majors)} but torch for CUDA {torch_cuda}: install "
                f"refit[gpu] (tensorrt-cu13) or refit[gpu-cu12] to match torch")
    return None


def tensorrt_unavailable_reason() -> str | None:
    """None when TensorRT and a CUDA device are usable here, else why not (one line)."""
    try:
        import tensorrt  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken install raising OSError
        first = (str(e).splitlines() or [type(e).__name__])[0][:160]
        return f"TensorRT is not installed here: {INSTALL_HINT} (import tensorrt: {first})"
    mismatch = cuda_major_mismatch()
    if mismatch is not None:
        return mismatch
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return f"TensorRT needs an NVIDIA GPU and no CUDA device is visible here: {INSTALL_HINT}"
    return None


def require_tensorrt():
    """The ``tensorrt`` module, or :class:`RefitError` in one line when it (or a GPU) is absent."""
    reason = tensorrt_unavailable_reason()
    if reason is not None:
        raise RefitError(reason)
    import tensorrt as trt

    return trt


# --------------------------------------------------------------------------- weight names

def trt_weight_name(onnx_initializer: str) -> str:
    """The refit name TensorRT gives an ONNX initializer: the same name (the parser sets it)."""
    return onnx_initializer


def refit_targets(manifest: Manifest, graph: str) -> dict[str, list[tuple[str, WeightTarget]]]:
    """{hf_name: [(trt_weight_name, its WeightTarget)]} for one graph, from the manifest's weight map."""
    out: dict[str, list[tuple[str, WeightTarget]]] = {}
    for hf_name, targets in manifest.weight_map.items():
        for t in targets:
            if t.graph == graph:
                out.setdefault(hf_name, []).append((trt_weight_name(t.engine), t))
    return out


def mapped_trt_names(manifest: Manifest, graph: str) -> list[str]:
    """Every TensorRT weight name of ``graph`` that the weight map feeds (what a refit writes): for a quantized
    engine (``--quantize int8``) each quantized weight's int8 twin and its scale in place of the fp32 name (kept
    too where another node still reads it, a tied embedding's Gather)."""
    twins = quantized_twins(manifest, graph)
    out = set()
    for ts in refit_targets(manifest, graph).values():
        for name, t in ts:
            tw = twins.get(t.engine)
            if tw is None or tw.keep_float:
                out.add(name)
            if tw is not None:
                out.update((trt_weight_name(tw.weight), trt_weight_name(tw.scale)))
    return sorted(out)


def quantized_twins(manifest: Manifest, graph: str) -> dict:
    """{fp32 engine weight: its QuantizedWeight} of ``graph`` (empty for an unquantized engine)."""
    q = manifest.quantization
    return dict(q.weights.get(graph, {})) if q is not None else {}


# ------------------------------------------------------------------------------------ build

def _device() -> TrtDevice:
    import torch

    major, minor = torch.cuda.get_device_capability()
    return TrtDevice(name=torch.cuda.get_device_name(), compute_capability=f"{major}.{minor}")


def _precision(trt, config, dtype: str, strongly_typed: bool, qdq: bool = False) -> str:
    """Set the builder's precision for the manifest dtype; returns what was chosen, for the manifest.

    TF32 is "Enabled by default" (NvInfer.h, ``BuilderFlag::kTF32``, TensorRT 10 and 11) for weakly and strongly typed
    networks alike, and an fp32 engine must compute in fp32 (token parity with the reference), so it is cleared for
    every fp32 engine (and the Q/DQ one's fp32 matmuls), in every mode; TensorRT 11 has strong typing only."""
    tf32 = getattr(trt.BuilderFlag, "TF32", None)
    if tf32 is not None and (qdq or dtype == "fp32"):
        config.clear_flag(tf32)
    if qdq:  # int8 weights through DequantizeLinear into fp32 matmuls
        return "strongly-typed Q/DQ (int8 weights, fp32 matmuls, TF32 off)"
    if strongly_typed:
        return "strongly-typed (graph dtypes, TF32 off)" if dtype == "fp32" else "strongly-typed (graph dtypes)"
    if dtype == "fp16":
        config.set_flag(trt.BuilderFlag.FP16)
        return "weak+FP16"
    if dtype == "bf16":
        config.set_flag(trt.BuilderFlag.BF16)
        return "weak+BF16"
    return "weak+FP32 (TF32 off)"


def _parse(trt, builder, logger, onnx_path: Path, strongly_typed: bool):
    flags = 0
    if strongly_typed:
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):  # the path locates the external *.onnx.data
        errs = "; ".join(str(parser.get_error(i)).replace("\n", " ") for i in range(parser.num_errors))
        raise RefitError(f"TensorRT's ONNX parser rejected {onnx_path.name}: {errs[:400]}")
    return network, parser  # the parser owns the weights: keep it alive until the build is done


def build_plan(trt, logger, onnx_path: Path, manifest: Manifest, graph: str, workspace_gb: float,
               strongly_typed: bool | None = None) -> tuple[object, tuple[str, ...], str]:
    """Serialized refittable engine for one graph (``IHostMemory``); (plan, profile names in order, precision)."""
    qdq = manifest.quantization is not None
    if qdq:  # explicit quantization: "use explicit quantization with strong typing; precision-control build flags
        # are not required and should not be specified" (TensorRT guide, Explicit Quantization); docs/int8.md
        strongly_typed = True
    if strongly_typed is None:  # TensorRT 11 dropped the precision flags: the graph's dtypes decide
        strongly_typed = not hasattr(trt.BuilderFlag, "FP16")
    builder = trt.Builder(logger)
    network, parser = _parse(trt, builder, logger, onnx_path, strongly_typed)
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gb * (1 << 30)))
    config.set_flag(trt.BuilderFlag.REFIT)
    precision = _precision(trt, config, manifest.dtype, strongly_typed, qdq)
    names = tuple(manifest.profiles[graph])
    for pname in names:
        profile = builder.create_optimization_profile()
        for inp, s in manifest.profiles[graph][pname].items():
            profile.set_shape(inp, s.min, s.opt, s.max)
        if config.add_optimization_profile(profile) < 0:
            raise RefitError(f"TensorRT rejected shape profile {graph}/{pname} (see the log above)")
    plan = builder.build_serialized_network(network, config)
    del parser
    if plan is None:
        raise RefitError(f"TensorRT failed to build {graph} from {onnx_path.name} (see the TensorRT log above)")
    return plan, names, precision


def inspect_plan(trt, logger, plan, manifest: Manifest, graph: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Deserialize ``plan``; check its I/O and profiles; (refittable weights, mapped weights not refittable)."""
    engine = trt.Runtime(logger).deserialize_cuda_engine(plan)
    if engine is None:
        raise RefitError(f"TensorRT could not deserialize the {graph} plan it just built")
    io = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    inputs = [n for n in io if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
    spec = manifest.graphs[graph]
    if set(inputs) != set(spec.inputs) or set(io) - set(inputs) != set(spec.outputs):
        raise RefitError(f"TensorRT {graph} engine I/O {io} differs from the manifest's")
    if engine.num_optimization_profiles != len(manifest.profiles[graph]):
        raise RefitError(f"TensorRT {graph} engine has {engine.num_optimization_profiles} profiles, "
                         f"manifest {len(manifest.profiles[graph])}")
    refittable = tuple(sorted(trt.Refitter(engine, logger).get_all_weights()))
    have = set(refittable)
    return refittable, tuple(n for n in mapped_trt_names(manifest, graph) if n not in have)


def _check_quantized(manifest: Manifest) -> None:
    """One line for a quantized folder TensorRT cannot build: only the weight-only Q/DQ scheme is TensorRT's."""
    q = manifest.quantization
    if q is not None and q.scheme != QDQ:
        raise RefitError(f"this engine folder is quantized for ONNX Runtime ({q.scheme}: MatMulInteger, which "
                         "TensorRT's parser lacks); re-export with --backend tensorrt --quantize int8 (Q/DQ)")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _up_to_date(engine_dir: Path, manifest: Manifest, trt_version: str, device: TrtDevice) -> bool:
    recs = manifest.tensorrt or {}
    if set(recs) != set(manifest.graphs):
        return False
    for g, rec in recs.items():
        if not (engine_dir / rec.plan).is_file() or rec.trt_version != trt_version:
            return False
        if rec.device.compute_capability != device.compute_capability:
            return False  # plans are specific to the GPU architecture they were built on
        if rec.graph_sha256 != manifest.graphs[g].sha256 or rec.not_refittable:
            return False
    return True


def build_engines(engine_dir: str | Path, workspace_gb: float = 4.0, log=print, strict: bool = True,
                  force: bool = False) -> dict[str, TrtPlan]:
    """Build ``<graph>.plan`` for every graph of ``engine_dir``; record them in the manifest.

    Sets the manifest's ``tensorrt`` section to ``{graph: TrtPlan}`` and returns it.
    With ``strict`` (default) a mapped weight that TensorRT made non-refittable is an error and
    nothing is written; otherwise it is listed under ``not_refittable`` (and refit refuses it).
    Plans already built for this graph, TensorRT version and GPU architecture are reused. The parity gate of the
    plans against PyTorch: :func:`refit.rollout.tensorrt.gate.build_gated` (what ``refit export`` runs).
    """
    trt = require_tensorrt()
    engine_dir = Path(engine_dir)
    manifest = Manifest.read(engine_dir)
    _check_quantized(manifest)
    device = _device()
    if not force and _up_to_date(engine_dir, manifest, trt.__version__, device):
        log(f"refit export: TensorRT engines in {engine_dir} are up to date, reused")
        return dict(manifest.tensorrt)
    logger = trt.Logger(trt.Logger.WARNING)
    records, tmp_plans = {}, []
    try:
        for graph, spec in manifest.graphs.items():
            t0 = time.perf_counter()
            plan, names, precision = build_plan(trt, logger, engine_dir / spec.file, manifest, graph, workspace_gb)
            refittable, folded = inspect_plan(trt, logger, plan, manifest, graph)
            if folded and strict:
                raise RefitError(f"TensorRT constant-folded {len(folded)} mapped weights of {graph} away, so refit "
                                 f"would leave them stale: {list(folded[:5])}")
            tmp = engine_dir / f".{graph}.plan.building-{os.getpid()}"  # renamed into place once all are built
            tmp_plans.append((tmp, engine_dir / f"{graph}.plan"))
            with open(tmp, "wb") as f:
                f.write(plan)
            size = tmp.stat().st_size
            del plan
            records[graph] = TrtPlan(
                plan=f"{graph}.plan", profiles=names, trt_version=trt.__version__, precision=precision, device=device,
                graph_sha256=_sha256(engine_dir / spec.file), plan_bytes=size,
                build_seconds=round(time.perf_counter() - t0, 3), refittable_weights=refittable, not_refittable=folded)
            log(f"refit export: TensorRT {graph}: {size / 2**20:.1f} MiB plan, profiles {list(names)}, {precision}, "
                f"{len(refittable)} refittable weights, built in {records[graph].build_seconds:.1f} s")
        for tmp, final in tmp_plans:
            os.replace(tmp, final)
        tmp_plans = []
        replace(manifest, tensorrt=records).write(engine_dir)  # atomic: temp file + os.replace
    finally:
        for tmp, _ in tmp_plans:
            tmp.unlink(missing_ok=True)
    return records
