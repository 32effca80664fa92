"""Make or reuse an engine folder for a backend: the one entry point for ``refit export``, both training
cycles and the benchmarks. It sits on the rollout floor because the parity gate it gives the exporter decodes
through the engine's own loop (refit.rollout.parity), and TensorRT plans are built for the engine that runs them.

    build(model_dir, engine_dir, backend, opts)
      1. ``tensorrt``: fail at once, in one line, where TensorRT is absent (before any export)
      2. reuse ``engine_dir`` when the weights and the options match (the exporter's cache key) or,
         for a training run, when it was exported from these weights and is large enough;
         otherwise export the ONNX graphs (parity-gated)
      3. ``tensorrt``: build (or reuse) the refittable TensorRT plans on top of the ONNX graphs

PyTorch backends (``torch``, ``hf``) run from the HF folder itself: :func:`engine_source` says
which folder a backend opens.
"""

from __future__ import annotations

from pathlib import Path

from refit.core.errors import RefitError
from refit.core.hf_folder import model_info
from refit.core.integrity import engine_lock, folder_holds, hold_folder, share_folder
from refit.core.manifest import MANIFEST, Manifest
from refit.core.memory import F32, available, engine_terms, geometry, refuse_if_over
from refit.export.guard import guard_engine, require_only_engine_files, require_tokenizer
from refit.export.onnx_export import export_onnx, weights_hash
from refit.export.options import ExportOptions, cache_key
from refit.export.quantize import scheme_for
from refit.rollout.config import ExportConfig, parse_export
from refit.rollout.parity import int8_parity_gate, parity_gate
from refit.rollout.tensorrt import build as trt_build  # its functions through the module: a test patches in a stand-in
from refit.rollout.tensorrt.gate import build_gated

TORCH_BACKENDS = ("torch", "hf")  # backends that open the HF checkpoint folder


def _scheme(quantize: str, backend: str) -> str:
    """The manifest's quantization scheme an engine for ``backend`` quantized as ``quantize`` has."""
    if quantize == "none":
        return "none"
    return scheme_for(backend)


def build(model_dir: str | Path, engine_dir: str | Path, backend: str = "onnxruntime",
          opts: ExportOptions | None = None, reuse_if_fits: int | None = None, log=print) -> Path:
    """Export (or reuse) ``engine_dir`` from ``model_dir`` for ``backend``; return ``engine_dir``.

    By default an export is reused only when the weights and ``opts`` are the same (the exporter's
    cache key). ``reuse_if_fits=max_len``: reuse any export of the same weights that serves a run of rows of up
    to that many tokens (:func:`_unfit`; a training run does not re-export because its batch changed).
    """
    model_dir, engine_dir = Path(model_dir), Path(engine_dir)
    opts = opts or ExportOptions()
    if backend == "tensorrt" and opts.attention == "auto":  # TensorRT builds from the standard-op graph
        from dataclasses import replace

        opts = replace(opts, attention="plain")
    if backend == "tensorrt" and opts.quantize != "none" and opts.backend != "tensorrt":
        from dataclasses import replace

        opts = replace(opts, backend="tensorrt")  # the Q/DQ graph (refit/export/quantize.py), not ONNX Runtime's int8
    if backend == "tensorrt":
        trt_build.require_tensorrt()  # one line, before anything is written
    old = _same_weights(engine_dir, model_dir) if reuse_if_fits else None
    reuse = old is not None and _unfit(old, reuse_if_fits, backend, opts.quantize, tuple(opts.lora)) is None
    write = backend == "tensorrt" or not (reuse or _up_to_date(engine_dir, model_dir, opts))
    lock, what = engine_lock(engine_dir), f"engine folder {engine_dir}"
    hold_folder(lock, what, log, shared=not write)  # readers share it; a writer excludes every other process
    if write:
        require_only_engine_files(engine_dir)  # a folder is written whole: nothing of the user's goes with it
        other = _manifest_of(engine_dir)
        if other is not None and other.hashes.hf_weights_sha256 != weights_hash(model_dir):  # written meanwhile
            raise RefitError(f"{what} now holds an engine of other weights (another process exported into it); "
                             "give another engine folder, or pass --overwrite to replace it")
    if reuse:
        log(f"refit: reusing engine {engine_dir} (exported from the same weights)")
    else:
        export_onnx(model_dir, engine_dir, opts, log=log, gate=parity_gate, int8_gate=int8_parity_gate)
    if backend == "tensorrt":
        build_gated(engine_dir, log=log)  # reuses plans built for the same graphs, TensorRT and GPU; gates new ones
    share_folder(lock)  # written and complete: from here on only read
    return engine_dir


def _manifest_of(engine_dir: Path):
    """``engine_dir``'s manifest, or None (no folder, no manifest, an unusable one)."""
    if not (engine_dir / MANIFEST).is_file():
        return None
    try:
        return Manifest.read(engine_dir)
    except RefitError:
        return None


def _up_to_date(engine_dir: Path, model_dir: Path, opts: ExportOptions) -> bool:
    """True when ``engine_dir`` holds this very export (the exporter's cache key): reusing it only reads it."""
    m = _manifest_of(engine_dir)
    return m is not None and m.cache_key == cache_key(model_dir, opts)


def check_memory(model_dir: str | Path, rows: int, max_len: int) -> None:
    """Refuse, before any work, an engine call of ``rows`` x ``max_len`` whose KV cache, logits and weights
    (refit.core.memory) exceed the host memory available, in one line with the estimate."""
    g = geometry(model_dir)
    if g is not None:
        terms = {**engine_terms(g, rows, max_len), "weights": F32 * g.params}
        refuse_if_over(terms, available(), f"an engine call of {rows} rows x {max_len} tokens of {model_dir}",
                       "of memory", "lower the batch (--run.batch_size) or the response length")


def _unfit(m, max_len: int, backend: str, quantize: str, lora: tuple[str, ...],
           round_weights: str = "none") -> str | None:
    """Why the engine of manifest ``m`` (these weights) cannot serve this run; None when it can. Its max_batch is
    no reason: a larger batch runs within it (refit.rollout.engine.LoopEngine)."""
    scheme = m.quantization.scheme if m.quantization else "none"
    has = tuple(m.lora.target_modules if m.lora else ())
    rounded = (m.options or {}).get("round_weights", "none")
    for bad, why in ((m.dims.max_len < max_len, "its max_len is too short"),
                     (backend == "tensorrt" and m.attention == "fused", "it has the fused-attention graph; the "
                                                                        "tensorrt backend builds from the plain one"),
                     (scheme != _scheme(quantize, backend), f"it is quantized {scheme}; this run needs "
                                                            f"{_scheme(quantize, backend)}"),
                     (has != tuple(lora), f"its LoRA targets are {list(has) or 'none'}; this run needs "
                                          f"{list(lora) or 'none'}"),
                     (rounded != round_weights, f"its weights are rounded to {rounded}; this run's learner holds "
                                                f"the base rounded to {round_weights}")):
        if bad:
            return why
    return None


def ensure_engine(model_dir: str | Path, engine_dir: str | Path, rows: int, max_len: int,
                  backend: str = "onnxruntime", log=print, quantize: str = "none", own: bool | None = None,
                  lora: tuple[str, ...] = (), round_weights: str = "none") -> Path:
    """A training run's engine: reuse an export of these weights that serves the run, else export one with headroom.

    A batch over the engine's max_batch runs within it, in calls of at most max_batch rows (LoopEngine): never a
    reason to export again. An engine of these weights that cannot serve (too short, another quantization, other
    LoRA targets) is exported again, never narrower than it was, only when it is Refit's own (``own``; default:
    it lies in a run folder, as a run's default engine does); a folder the user named is never re-exported: it is
    refused in one line naming its limits and the run's."""
    model_dir, engine_dir = Path(model_dir), Path(engine_dir)
    old = _same_weights(engine_dir, model_dir)
    check_memory(model_dir, min(rows, old.dims.max_batch) if old is not None else rows, max_len)
    why = _unfit(old, max_len, backend, quantize, tuple(lora), round_weights) if old is not None else None
    if why is not None:
        d = old.dims
        if not (own if own is not None else folder_holds(engine_dir.parent) == "run"):
            flags = (f" --quantize {quantize}" if quantize != "none" else "") + (" --backend tensorrt" if backend ==
                                                                                 "tensorrt" else "")
            flags += f" --lora {' '.join(lora)}" if lora else ""
            flags += f" --round_weights {round_weights}" if round_weights != "none" else ""
            raise RefitError(f"engine folder {engine_dir} (max_batch {d.max_batch}, max_len {d.max_len}) cannot "
                             f"serve this run ({rows} rows of up to {max_len} tokens): {why}; export another "
                             f"engine (refit export {model_dir} -o NEW_DIR --max_batch {d.max_batch} --max_len "
                             f"{max(max_len, d.max_len)}{flags}) and pass it (--model.engine_dir NEW_DIR), or "
                             "shorten the run's prompts or responses")
        log(f"refit: this run's engine {engine_dir} cannot serve it ({why}): exporting it again")
        rows, max_len = max(rows, d.max_batch), max(max_len, d.max_len)
    elif old is not None and old.dims.max_batch < rows:
        log(f"refit: engine {engine_dir} takes {old.dims.max_batch} rows per call (max_batch): this run's {rows} "
            f"rows run in calls of at most {old.dims.max_batch}")
    opts = ExportOptions(max_batch=max(rows, 64), max_len=max(max_len, 128), quantize=quantize, lora=tuple(lora),
                         round_weights=round_weights)
    return build(model_dir, engine_dir, backend, opts, reuse_if_fits=max_len, log=log)


def _same_weights(engine_dir: Path, model_dir: Path):
    """``engine_dir``'s manifest when it is an export of ``model_dir``'s weights, else None."""
    m = _manifest_of(engine_dir)
    return m if m is not None and m.hashes.hf_weights_sha256 == weights_hash(model_dir) else None


def engine_source(backend: str, model_dir: str | Path, engine_dir: str | Path, rows: int, max_len: int,
                  log=print, quantize: str = "none", lora: tuple[str, ...] = (), round_weights: str = "none") -> Path:
    """The folder ``backend`` opens: the HF folder for PyTorch backends, else an ensured engine folder."""
    if lora and backend != "onnxruntime":  # TensorRT's LoRA runs refit merged layers into a plain engine
        raise RefitError(f"a LoRA-ready engine (adapter inputs) is built for rollout.backend onnxruntime; the "
                         f"{backend} backend takes none (tensorrt: refit of the merged targeted layers, docs/lora.md)")
    if backend in TORCH_BACKENDS:
        if quantize != "none":
            raise RefitError(f"rollout.quantize {quantize} needs an engine backend (onnxruntime or tensorrt), "
                             f"not {backend}")
        return Path(model_dir)
    return ensure_engine(model_dir, engine_dir, rows, max_len, backend, log, quantize, lora=lora,
                         round_weights=round_weights)


def plain_twin(model_dir: str | Path, engine_dir: str | Path, out: str | Path | None = None, log=print) -> Path:
    """The standard-op (plain attention) graphs of ``engine_dir``'s model, the ones TensorRT builds from:
    ``engine_dir`` itself when it already holds them, else exported (or reused: the exporter's cache key)
    into ``out`` (default: beside it, ``<engine_dir>-plain``) with the same batch and length limits."""
    engine_dir = Path(engine_dir)
    m = Manifest.read(engine_dir)
    if m.attention != "fused":
        return engine_dir
    out = Path(out) if out is not None else engine_dir.with_name(engine_dir.name + "-plain")
    return build(model_dir, out, opts=ExportOptions(max_batch=m.dims.max_batch, max_len=m.dims.max_len,
                                                    dtype=m.dtype, attention="plain"), log=log)


# ------------------------------------------------------------------------------------ refit export

def main(argv: list[str] | None = None) -> int:
    return run_export(parse_export(argv))


def run_export(a: ExportConfig) -> int:
    """``refit export`` after :func:`~refit.rollout.config.parse_export` checked its command line (no torch)."""
    model_info(Path(a.model_dir))  # not a checkpoint, an unknown model type: said before the tokenizer
    require_tokenizer(a.model_dir)
    guard_engine(a.model_dir, a.out, a.overwrite)  # another model's engine, a model or a run: refused
    opts = ExportOptions(backend=a.backend, dtype=a.dtype, max_batch=a.max_batch, max_len=a.max_len,
                         parity_tol=a.parity_tol, attention=a.attention, quantize=a.quantize, lora=tuple(a.lora),
                         round_weights=a.round_weights)
    print(build(a.model_dir, a.out, opts.backend, opts))
    return 0
