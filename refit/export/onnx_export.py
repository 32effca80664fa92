"""HF checkpoint folder -> ONNX engine folder (graphs with KV cache, refittable weights, manifest).

Choice of exporter: ``torch.onnx.export(dynamo=True)``
(torch.export + onnxscript) with the small wrappers in :mod:`refit.export.wrappers`. It works on the
transformers 5.x line that users are on; optimum's exporter pins transformers < 4.58. Its
default optimisations rename, pre-transpose and merge weights, so the exporter traces the model
with fingerprinted weights (overwritten in place) and builds the HF -> engine weight map by content
(:mod:`refit.export.weight_map`); the real weights are then written through that map.

Steps (each cached, Polygraphy-style): load + validate -> fingerprint in place, trace graphs, map weights ->
load the real weights again, write graphs with external weight data -> parity gate (given by the caller) ->
manifest -> atomic rename. One PyTorch model is alive at a time, and the weights are not copied on the way to
disk (numpy views of the traced graphs for the map, placeholders in the protos, bytes written from the
tensors' memory); each stage's peak RSS is printed and the whole export's recorded (``export_peak_rss_mb``).

The options and the cache key are :mod:`refit.export.options`'s; the trace and the weight map,
:mod:`refit.export.trace`'s.
"""

from __future__ import annotations

import gc
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from refit.core.hf_folder import ModelInfo, load_model, load_tokenizer, model_info
from refit.core.contract import PARITY_TOL, weights_hash
from refit.core.errors import RefitError
from refit.core.integrity import folder_hashes, sha256_files as _sha256_files
from refit.core.manifest import MANIFEST, Manifest
from refit.core.manifest_sections import Dims, GraphSpec, Hashes, Padding, Parity, SpecialIds
from refit.export.capabilities import Capabilities, detect
from refit.export.fused import fused_dynamic_dims, fused_profiles, supports_fused
from refit.export.fused_seq2seq import seq2seq_refusal
from refit.export.graph import write_graph as _write_graph
from refit.export.memory import StagePeaks
from refit.export.moe import is_moe, moe_refusal
from refit.export.options import ExportOptions, cache_key, check_quantize, recorded_options
from refit.export.precision import engine_run_on_cpu, graph_dtype_problems
from refit.export.profiles import dynamic_dims, shape_profiles
from refit.export.quantize import quantize_folder
from refit.export.trace import OPSET, trace_and_map
from refit.export.weight_map import DTYPES, canonical_params, engine_weight_views, rounded


def _moe_check(model, model_dir: Path) -> bool:
    """True when ``model`` has mixture-of-experts blocks the exporter can put in the graph; RefitError
    (one line) when it has blocks it cannot (:func:`refit.export.moe.moe_refusal`)."""
    if not is_moe(model):
        return False
    reason = moe_refusal(model)
    if reason is not None:
        raise RefitError(f"cannot export {model_dir}: mixture-of-experts layer not supported: {reason}")
    return True


def _versions() -> dict:
    import onnx
    import onnxruntime
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__}


def _check_out_dir(out_dir: Path, key: str) -> bool:
    """True when ``out_dir`` already holds this exact export; error if it holds something else."""
    if not out_dir.exists():
        return False
    if not out_dir.is_dir():
        raise RefitError(f"output {out_dir} exists and is not a folder")
    if not (out_dir / MANIFEST).exists():
        if any(out_dir.iterdir()):
            raise RefitError(f"output folder {out_dir} holds something else (no {MANIFEST}); refusing to overwrite it")
        return False
    try:
        return Manifest.read(out_dir).cache_key == key
    except RefitError:  # corrupt, another format or inconsistent: export again over it
        return False


def _atomic_replace(tmp: Path, out_dir: Path) -> None:
    """Swap ``tmp`` into place; an old engine folder is removed only after the new one is in."""
    old = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


Gate = Callable[..., Parity]  # (model, folder, manifest, tokenizer, tol) -> the parity record, or RefitError


def export_onnx(model_dir: str | Path, out_dir: str | Path, opts: ExportOptions = ExportOptions(),
                log=print, *, gate: Gate, int8_gate: Callable[..., Manifest] | None = None) -> Path:
    """Export ``model_dir`` to the engine folder ``out_dir`` (reused when weights and options match).

    ``gate`` judges the written folder before it is moved into place: the exporter runs nothing itself;
    :func:`refit.rollout.build.build` passes :func:`refit.rollout.parity.parity_gate`, which decodes through
    the engine's own loop, and ``int8_gate`` (:func:`refit.rollout.parity.int8_parity_gate`) for ``--quantize int8``.
    """
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    info = model_info(model_dir)
    tok = load_tokenizer(model_dir, info)
    if opts.dtype not in DTYPES:
        raise RefitError(f"unknown dtype {opts.dtype!r}; choose fp32, fp16 or bf16")
    check_quantize(opts)
    key = cache_key(model_dir, opts)
    if _check_out_dir(out_dir, key):
        log(f"refit export: {out_dir} is up to date (same weights and options), reused")
        return out_dir
    t0 = time.perf_counter()
    peaks = StagePeaks()
    dtype = DTYPES[opts.dtype]
    load = lambda: rounded(load_model(model_dir, info, dtype=dtype), opts.round_weights)  # noqa: E731
    model = load()
    with torch.no_grad():  # refuses, in one line, a model without what the engines need; nothing written yet
        caps = detect(model, info.kind, info.padding_side, info.pad_id, model_dir)
    moe = _moe_check(model, model_dir)  # one line, before anything is written

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    attention, why = choose_attention(model, caps, opts)
    models = _OneModel(load, model)
    del model  # held by ``models`` only: it is fingerprinted in place for the trace
    peaks.mark("load")
    while True:
        tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            manifest = _export_to(tmp, models, info, caps, tok, opts, key, (attention, why), model_dir, t0,
                                  (gate, int8_gate), moe, peaks)
            _atomic_replace(tmp, out_dir)
            break
        except Exception as e:  # noqa: BLE001 - under "auto" a failing fused graph falls back to plain
            if attention != "fused" or opts.attention != "auto":
                raise
            attention, why = "plain", f"fused graph failed ({str(e).splitlines()[0][-300:]}); fell back to plain"
            log(f"refit export: {why}")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    p = manifest.parity
    log(peaks.line())
    log(f"refit export: wrote {out_dir} in {manifest.export_seconds:.1f} s; parity max|dlogit|="
        f"{p.max_abs_logit_diff:.2e} max|dlogprob|={p.max_abs_logprob_diff:.2e} (tol {p.tolerance_logprob:g}; "
        f"attention {manifest.attention}; peak RSS {manifest.export_peak_rss_mb} MB)")
    return out_dir


class _OneModel:
    """The export's one PyTorch model at a time. :meth:`take` hands out the model as first loaded (it is then
    fingerprinted in place and traced), and after that a fresh load with the real weights (written, then the
    parity gate's reference); the exporter keeps no other reference, so the fingerprinted model is gone before
    the real one is loaded again (reading a safetensors checkpoint costs seconds; a second model in memory
    costs its size)."""

    def __init__(self, load: Callable, first=None):
        self._load, self._first = load, first

    def take(self):
        model, self._first = self._first, None
        return model if model is not None else self._load()


def choose_attention(model, caps: Capabilities, opts: ExportOptions) -> tuple[str, str]:
    """("fused" | "plain", why) for ``opts.attention``; RefitError when "fused" is asked for where it cannot run."""
    if opts.attention not in ("auto", "fused", "plain"):
        raise RefitError(f"unknown attention {opts.attention!r}; choose auto, fused or plain")
    if opts.attention == "plain":
        return "plain", "asked for (attention=plain)"
    reason = supports_fused(model, caps, opts.backend, opts.dtype)
    if reason is None and caps.kind != "decoder":
        reason = seq2seq_refusal(model)
    if reason is None:
        return "fused", f"{opts.attention}: GroupQueryAttention over a preallocated KV buffer"
    if opts.attention == "fused":
        raise RefitError(f"attention=fused does not apply here: {reason}")
    return "plain", reason


def _export_to(tmp: Path, models: _OneModel, info: ModelInfo, caps: Capabilities, tok, opts: ExportOptions,
               key: str, attention: tuple[str, str], model_dir: Path, t0: float, gates: tuple, moe: bool,
               peaks: StagePeaks) -> Manifest:
    """Trace, map, write and gate one engine folder in ``tmp``; returns its manifest.

    One PyTorch model at a time (``models``): the traced one, fingerprinted in place, is dropped before the real
    weights are loaded again to be written (through lazy views of the map, one engine tensor at a time) and
    to be the parity gate's reference."""
    gate, int8_gate = gates
    fused = attention[0] == "fused"
    dtype = DTYPES[opts.dtype]
    io, protos, wmap, constants, lora = trace_and_map(models.take(), caps, attention[0], dtype, moe, tuple(opts.lora))
    gc.collect()  # the exporter's reference cycles hold the traced (fingerprinted) model
    peaks.mark("trace+map")
    model = models.take()
    params, tied = canonical_params(model)
    if set(params) != set(wmap):  # the same checkpoint loaded twice: the same names
        raise RefitError(f"{model_dir} loaded again has other weights than the traced model "
                         f"({sorted(set(params) ^ set(wmap))[:3]})")
    real = engine_weight_views(params, wmap, dtype)
    graphs = {}
    for name, (inputs, outputs) in io.items():
        path = tmp / f"{name}.onnx"
        _write_graph(protos.pop(name), real.get(name, {}), path)
        graphs[name] = GraphSpec(
            file=path.name, data=path.name + ".data", inputs=inputs, outputs=outputs,
            sha256=_sha256_files([path]), weights_sha256=_sha256_files([tmp / (path.name + ".data")]))
    peaks.mark("write")
    tok.save_pretrained(str(tmp / "tokenizer"))
    shutil.copy(model_dir / "config.json", tmp / "config.json")
    manifest = replace(_manifest(info, caps, opts, key, graphs, wmap, tied, model_dir, time.perf_counter() - t0),
                       attention=attention[0], attention_reason=attention[1], constants=constants or None,
                       lora=lora)
    manifest = replace(manifest, hashes=replace(manifest.hashes, tokenizer_sha256=folder_hashes(tmp / "tokenizer")))
    if fused:
        seq2seq = caps.kind != "decoder"
        manifest = replace(manifest, dynamic_dims=fused_dynamic_dims(seq2seq),
                           profiles=fused_profiles(caps, opts.max_batch, opts.max_len, seq2seq))
    manifest.write(tmp)
    check_precision(tmp, graphs, wmap, opts.dtype)
    files, engine_run = engine_run_on_cpu(tmp, graphs, opts.dtype)
    tol = opts.parity_tol if opts.parity_tol is not None else PARITY_TOL[opts.dtype]
    try:
        parity = gate(model, tmp, manifest, tok, tol, files=files, engine_run=engine_run)
    finally:
        for f in (files or {}).values():
            (tmp / f).unlink(missing_ok=True)
    manifest = replace(manifest, parity=parity, export_seconds=round(time.perf_counter() - t0, 3))
    peaks.mark("gate")
    if opts.quantize != "none":  # int8 twins of the gated fp32 graphs, gated again (by the caller's int8 gate)
        if int8_gate is None:
            raise RefitError("quantize int8: this caller gave the exporter no int8 gate (refit.rollout.build.build does)")
        manifest = int8_gate(tmp, quantize_folder(tmp, manifest, model, real), model, tok)
        manifest = replace(manifest, export_seconds=round(time.perf_counter() - t0, 3))
        peaks.mark("int8")
    manifest = replace(manifest, export_peak_rss_mb=peaks.peak_mb)
    manifest.write(tmp)
    return manifest


def check_precision(folder: Path, graphs: dict[str, GraphSpec], wmap: dict, dtype: str) -> None:
    """The graph side of a reduced-precision export (refit/export/precision.py), before the gate: one RefitError
    line listing what is off (the ONNX checker, a float input/output or a mapped weight not in ``dtype``)."""
    if dtype == "fp32":
        return
    problems = []
    for g, spec in graphs.items():
        targets = {t.engine: t.stored_dtype for ts in wmap.values() for t in ts if t.graph == g}
        problems += graph_dtype_problems(folder / spec.file, dtype, targets)
    if problems:
        raise RefitError(f"{dtype} export: {len(problems)} problems in the graphs, e.g. {problems[:3]}")


def _position_limit(info: ModelInfo, caps: Capabilities) -> int | None:
    """Tokens a table of positions covers (learned, sinusoidal); rotary and relative ones have no table."""
    return info.max_positions if caps.positions in ("learned", "sinusoidal") else None


def _position_rule(caps: Capabilities) -> str:
    if caps.kind == "decoder":
        return f"cumsum(attention_mask)-1, 1 on padding ({caps.positions} positions)"
    return (f"{caps.positions} positions: encoder from 0 on its {caps.padding_side}-padded input, "
            "decoder from the cache length")


def _manifest(info: ModelInfo, caps: Capabilities, opts: ExportOptions, key: str, graphs: dict[str, GraphSpec],
              wmap: dict, tied: dict[str, str], model_dir: Path, export_s: float) -> Manifest:
    return Manifest(
        backend="onnx", model_type=info.model_type, architecture=info.architecture, kind=info.kind,
        dtype=opts.dtype, opset=OPSET, source_model=str(model_dir.resolve()),
        padding=Padding(
            prompt_side=info.padding_side,
            position_ids=_position_rule(caps),
            response_side="right",
            rule="decoder-only: left-padded prompts; encoder-decoder: encoder padded on its native side"),
        special_ids=SpecialIds(pad=info.pad_id, eos=info.eos_id, decoder_start=caps.decoder_start_id),
        dims=Dims(vocab_size=info.vocab_size, n_layers=caps.n_layers, n_kv_heads=caps.n_kv_heads,
                  head_dim=caps.head_dim, max_positions=_position_limit(info, caps),
                  max_batch=opts.max_batch, max_len=opts.max_len),
        graphs=graphs,
        dynamic_dims=dynamic_dims(caps),
        profiles=shape_profiles(caps, opts.max_batch, opts.max_len),
        weight_map=wmap,
        tied=tied,
        hashes=Hashes(hf_weights_sha256=weights_hash(model_dir),
                      graphs_sha256={g: v.sha256 for g, v in graphs.items()},
                      engine_weights_sha256={g: v.weights_sha256 for g, v in graphs.items()}),
        cache_key=key,
        options=recorded_options(opts),
        versions=_versions(),
        trace_seconds=round(export_s, 3),
        capabilities=caps,
    )
