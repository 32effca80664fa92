"""``OrtEngine``: generation and scoring on an engine folder with ONNX Runtime.

Weights. The engine holds every mapped weight as a torch tensor ``{graph: {engine_name: t}}``
(the held set) and always hands them to ONNX Runtime with ``add_external_initializers``
(:func:`refit.export.graph.open_session`), which copies them into the session as it opens; the
``.onnx.data`` files are read once, at start-up, through the graph's external-data records
(:func:`refit.rollout.ort_weights.read_engine_weights`).
Reading the engine's own files (rather than loading the source HF model and mapping it with
``engine_weights``) keeps the folder self-contained (the source model need not be on the
rollout machine), costs no PyTorch model in memory, and starts from exactly the bytes the
parity gate checked. The held set is one copy of the model beside the sessions' own; an engine opened with
``hold_weights=False`` keeps none (its sessions read the files; it then takes complete pushes only), which is
how a training job opens its engines: at real sizes that copy decides whether a PPO step fits in memory
(docs/families.md, "Published geometries").

Weight push. ``update_weights`` maps HF tensors through the manifest's ``weight_map``
(transpose included, tied aliases folded), closes the sessions of the graphs a pushed weight
feeds and opens new ones over the same graph files straight from the mapped tensors, then
copies those into the held set in place (the snapshot a later partial push needs). The other
route, turning every initializer into a graph input bound per run, was measured and dropped:
see docs/weight-push.md for the numbers. ``push_via="file"`` writes the push to scratch graph files instead
(:func:`refit.rollout.ort_weights.write_pushed_graphs`) and opens the new sessions from them.

Decoding uses IO binding: the present K/V ``OrtValue``s of one step are bound as the next
step's past (and the encoder's cross K/V for the whole batch) without numpy round trips; only the
logits come back to the host, viewed as a torch tensor without a copy.

Threads (docs/engine-step.md). ``threads`` is the session's intra-op count (None: the runtime's default,
every physical core). On cores shared with other jobs one thread is faster at small-model shapes: a
parallel node waits for a descheduled worker. The step itself is bounded by GroupQueryAttention reading the
KV cache, not by its arithmetic (docs/engine-step.md).
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path

import numpy as np
import torch

from refit.core.errors import RefitError
from refit.core.manifest import Manifest
from refit.core.padding import position_ids_from_mask
from refit.export.graph import default_providers, keep_freed_memory, open_session
from refit.export.quantize import QDQ, quantize_push
from refit.export.weight_map import engine_weight_views, engine_weights
from refit.rollout.engine import LoopEngine, ModelSpec, next_version, resolve_names
from refit.rollout.ort_adapter import AdapterSessions, AdapterSlots
from refit.rollout.ort_fused import FusedDecoderState, FusedSeq2SeqState, KVPool
from refit.rollout.ort_run import run_bound
from refit.rollout.ort_weights import (engine_weight_shapes, push_scratch, read_engine_weights, remove_graph_pair,
                                       write_pushed_graphs)
from refit.rollout.sampling import one_thread

_TORCH_DTYPE = {"fp32": torch.float32, "fp16": torch.float16}


def _logits(val) -> torch.Tensor:
    """Host logits OrtValue -> torch tensor in the engine dtype, a view (no copy); callers slice, then .float()."""
    return torch.from_numpy(val.numpy())


class _OrtDecoderState:
    """Present K/V (as OrtValues) and the running attention mask of one decoder-only batch."""

    def __init__(self, eng: "OrtEngine"):
        self.eng, self.sess = eng, eng.sessions["decoder"]
        self.outputs = eng.manifest.graphs["decoder"].outputs
        self.mask = self.past = None

    def _run(self, ids: np.ndarray, pos: np.ndarray, keep: np.ndarray) -> torch.Tensor:
        host = {"input_ids": ids, "attention_mask": self.mask, "position_ids": pos, "logits_index": keep}
        outs = run_bound(self.sess, self.eng.device, host, self.past, self.outputs)
        self.past = {n.replace("present", "past", 1): v for n, v in outs.items() if n != "logits"}
        return _logits(outs["logits"])

    def prefill(self, ids, mask):
        self.mask = mask.numpy().astype(np.int64)
        self.past = self.eng.empty_kv("past", ids.shape[0], 0)
        last = np.array([ids.shape[1] - 1], np.int64)  # left padding: every row's last token is there
        return self._run(ids.numpy(), position_ids_from_mask(self.mask), last)[:, -1].float()

    def extend(self, ids, mask):
        self.mask = np.concatenate([self.mask, mask.numpy().astype(np.int64)], 1)
        c = ids.shape[1]
        return self._run(ids.numpy(), position_ids_from_mask(self.mask)[:, -c:], np.arange(c, dtype=np.int64)).float()


class _OrtSeq2SeqState:
    """Cross K/V from one encoder run, and the decoder's self-attention K/V, as OrtValues."""

    def __init__(self, eng: "OrtEngine"):
        self.eng = eng
        self.graphs = eng.manifest.graphs
        self.cross = self.past = self.enc_mask = None

    def prefill(self, ids, mask):
        self.enc_mask = mask.numpy().astype(np.int64)
        enc = run_bound(self.eng.sessions["encoder"], self.eng.device,
                        {"input_ids": ids.numpy(), "attention_mask": self.enc_mask}, {},
                        self.graphs["encoder"].outputs)
        self.cross = {n: v for n, v in enc.items() if n.startswith("cross.")}
        self.past = self.eng.empty_kv("past", ids.shape[0], 0)
        start = np.full((ids.shape[0], 1), self.eng.spec.decoder_start_id, dtype=np.int64)
        return self.extend(torch.from_numpy(start), None)[:, -1]

    def extend(self, ids, mask):  # no decoder mask input: finished rows' outputs are ignored
        host = {"decoder_input_ids": ids.numpy(), "encoder_attention_mask": self.enc_mask}
        outs = run_bound(self.eng.sessions["decoder"], self.eng.device, host, {**self.cross, **self.past},
                         self.graphs["decoder"].outputs)
        self.past = {n.replace("present", "past", 1): v for n, v in outs.items() if n != "logits"}
        return _logits(outs["logits"]).float()


def _frozen_view(*_, **__) -> None:
    raise RefitError("update_weights: this is an engine's adapter-off view (the frozen reference); it takes no push")


class OrtEngine(LoopEngine):
    """Engine over an engine folder's ONNX graphs; ``device="cuda"`` uses the CUDA provider.

    ``slots`` (fused-attention engines): decode at most that many rows at once, refilling a slot as
    soon as its row stops (in-flight batching, refit/rollout/decode.py; ``inflight=False``, and always on an
    encoder-decoder engine: consecutive static batches of ``slots`` rows); rows are the same as without.
    ``keep_heap`` (default on) calls :func:`refit.export.graph.keep_freed_memory` once for the process,
    so each weight push's new session reuses the memory of the one it replaces.
    ``hold_weights=False``: the sessions read the weights from the folder's files themselves and the engine keeps
    no copy of them in Python: one copy of the model fewer (the export's parity gate; a job's reference, teacher
    and policy engines, refit.learner.run.engines). It then takes only complete pushes, every weight of each
    graph a push touches (what a training job pushes: ``canonical_params`` of the whole model), since the values
    of weights left out would have to come from a copy; a partial push is refused in one line.
    ``prepack=False`` (with ``hold_weights=False``: PPO's frozen reference engine): ONNX Runtime does not pre-pack
    the matmul weights, so the sessions read them straight from the folder's files, mapped (page cache, which
    the kernel may reclaim) rather than copied into packed buffers of their own: much less memory, scoring
    a little slower and generation about half as fast (docs/performance.md), so it suits an engine that only
    scores.
    ``push_via="file"`` (with ``hold_weights=False``, fp32/fp16/bf16 engines): a push writes the mapped weights,
    one tensor at a time, to a graph + data file pair in a scratch folder beside the engine folder (never into
    it) and opens the new sessions from those files, which ONNX Runtime maps. The memory route holds every
    transposed weight at once and ONNX Runtime's copy of each beside its packed one while the session opens
    (~2x the model more than the engine's resting size); this route holds one tensor and the packed weights.
    It costs a write of the model per push (page cache, flushed by the kernel when it likes).
    ``shards`` > 1: ``generate`` cuts its rows at prompt boundaries into that many shards and decodes each on a
    thread of its own over KV buffers of its own, every shard running the same sessions (ONNX Runtime's ``Run`` may
    be called from several threads at once and releases the GIL); ``threads`` is then the engine's whole budget,
    each run getting ``threads // shards`` intra-op threads (at least 1; ``threads`` None: every core). Rows are the
    same as without (tested). At small-model, large-batch shapes a second core is worth more this way than as a
    second intra-op thread, whose hand-offs at every one of a step's ~120 small nodes cost more than it brings
    (docs/engine-step.md, "Shards").
    """

    def __init__(self, engine_dir, device: str = "cpu", threads: int | None = None, opt_level: str = "all",
                 keep_heap: bool = True, slots: int | None = None, inflight: bool = True,
                 graph_files: dict[str, str] | None = None, hold_weights: bool = True, prepack: bool = True,
                 push_via: str = "memory", shards: int = 1):
        self.engine_dir = Path(engine_dir)
        self.manifest = Manifest.read(self.engine_dir)
        self.spec = ModelSpec.from_manifest(self.manifest)
        if device not in ("cpu", "cuda"):
            raise RefitError(f"onnxruntime backend: device must be 'cpu' or 'cuda', got {device!r}")
        if self.manifest.attention == "fused" and device != "cpu":  # before any provider or session work
            raise RefitError(f"{self.engine_dir} has the fused-attention graph, run here on the CPU provider "
                             "only (not tested on CUDA); use device='cpu' or re-export with attention=plain")
        # graph_files: {graph: file} run instead of the manifest's, the export's CPU twin of a bf16 graph
        # (refit.export.precision.cpu_twin): bf16 weights, fp32 at its inputs and outputs (K/V included)
        self._files = {g: (graph_files or {}).get(g, spec.file) for g, spec in self.manifest.graphs.items()}
        if self.manifest.dtype not in _TORCH_DTYPE and not graph_files:
            raise RefitError(f"onnxruntime backend runs fp32/fp16 engines; {self.engine_dir} is "
                             f"{self.manifest.dtype}: ONNX Runtime's CPU provider has no {self.manifest.dtype} "
                             "compute kernels (the export gated it through a CPU twin, refit/export/precision.py); "
                             "run it with the tensorrt backend on a GPU, or re-export with --dtype fp16")
        if not isinstance(shards, int) or shards < 1:
            raise RefitError(f"onnxruntime backend: shards must be an integer >= 1, got {shards!r}")
        if keep_heap:
            keep_freed_memory()
        self.device, self.shards = device, shards
        if shards > 1:  # the budget shared out: each concurrent run gets its part as intra-op threads
            threads = max(1, (threads or os.cpu_count() or 1) // shards)
        self._providers = default_providers(device)
        quant = self.manifest.quantization
        if opt_level in ("extended", "all") and quant is not None and quant.scheme == QDQ:
            # TensorRT's Q/DQ graph (refit/export/quantize.py) run as its standard ops say: DequantizeLinear, then an
            # fp32 matmul. ONNX Runtime's extended/all levels fuse DequantizeLinear + MatMul into MatMulNBits with int8
            # activations (accuracy level 4): measured 5.3e-3 max |dlogit| on tiny-gpt2, vs 0 at "basic"
            opt_level = "basic"
        self._threads, self._opt_level, self._prepack = threads, opt_level, prepack
        self._dtype = _TORCH_DTYPE.get(self.manifest.dtype, torch.float32)  # activations and K/V at the graph's edges
        self._weight_dtype = {**_TORCH_DTYPE, "bf16": torch.bfloat16}[self.manifest.dtype]
        # the held set, our own buffers; None: the sessions read the files, no push (hold_weights=False)
        self.weights = read_engine_weights(self.engine_dir, self.manifest) if hold_weights else None
        if push_via not in ("memory", "file"):
            raise RefitError(f"onnxruntime backend: push_via must be 'memory' or 'file', got {push_via!r}")
        if push_via == "file" and (hold_weights or quant is not None):
            raise RefitError("onnxruntime backend: push_via='file' needs hold_weights=False and an engine that is "
                             f"not quantized ({self.engine_dir} is {quant.scheme if quant else 'held'})")
        self._push_via, self._scratch, self._graph_src = push_via, None, dict(self._files)
        self._shapes = ({g: {n: tuple(t.shape) for n, t in w.items()} for g, w in self.weights.items()}
                        if hold_weights else engine_weight_shapes(self.engine_dir, self.manifest))
        self.sessions = self._open({g: {} for g in self.manifest.graphs})
        self.adapter = None  # a LoRA-ready engine's adapter (refit/rollout/ort_adapter.py), bound into every run
        if self.manifest.lora is not None:
            self.adapter = AdapterSlots(self.manifest.lora, np.float16 if self._dtype == torch.float16 else np.float32)
            self.sessions = AdapterSessions(self.sessions, self.adapter)
        self._version = 0
        self.last_push_s: dict[str, float] = {}  # update_weights' phases, seconds (see there); {} before a push
        self.slots = slots  # at most this many rows decoded at once; None: all rows in one batch
        self.max_batch = self.manifest.dims.max_batch  # the rows one run takes (its profiles); more: split (LoopEngine)
        self.inflight = inflight  # refill a slot as soon as its row stops (fused graph); False: static batches
        self._kv_pools = self._make_pools()  # one per shard: a shard's decode writes its own buffers

    def _make_pools(self) -> list:
        """A fused engine's KV buffer pools, one per shard (refit/rollout/ort_fused.py); [] for the plain graph."""
        if self.manifest.attention != "fused":
            return []
        d = self.manifest.dims
        names = [n for n in self.manifest.graphs["decoder"].inputs if n.startswith("past.")]
        np_dtype = np.float16 if self._dtype == torch.float16 else np.float32
        return [KVPool(names, d.n_kv_heads, d.head_dim, np_dtype, d.max_len) for _ in range(self.shards)]

    def adapter_off(self) -> "OrtEngine":
        """This engine with its LoRA adapter off: the base, over the same sessions (one copy of the base weights in
        memory), with KV buffers of its own. PPO's frozen reference on a LoRA run. It takes no pushes; a push of
        the base into this engine (which a LoRA run never makes) would leave it on the sessions it had."""
        if self.adapter is None:
            raise RefitError(f"adapter_off: {self.engine_dir} is not a LoRA-ready engine (export it with --lora)")
        view = copy.copy(self)
        view.sessions, view.adapter, view._kv_pools = self.sessions.raw, None, self._make_pools()
        view.update_weights = _frozen_view
        return view

    def _open(self, new: dict[str, dict[str, torch.Tensor]]) -> dict:
        """{graph: session} over each graph file: ``new[graph]`` weights, the held ones for the rest.

        ONNX Runtime copies every supplied buffer while the session opens (refit.export.graph.open_session),
        so ``new`` may be the learner's own tensors: nothing refers to them once this returns.
        """
        fresh = {}
        for g, override in new.items():
            if self.weights is None and not override:  # nothing held: ONNX Runtime reads the graph's data files
                fresh[g] = open_session(self.engine_dir / self._files[g], None, self._threads, self._providers,
                                        self._opt_level, self._prepack)[0]
                continue
            # not held: a complete push (update_weights checked it); held: the push over the held set
            arrays = override if self.weights is None else {n: override.get(n, t) for n, t in self.weights[g].items()}
            fresh[g] = open_session(self.engine_dir / self._files[g], arrays,
                                    self._threads, self._providers, self._opt_level, self._prepack)[0]
        return fresh

    def empty_kv(self, prefix: str, batch: int, length: int) -> dict:
        """Zero-length (or zero) K/V OrtValues ``{prefix.i.key|value: (B, H_kv, length, D)}`` on the device."""
        import onnxruntime as ort

        d = self.manifest.dims
        dtype = np.float16 if self._dtype == torch.float16 else np.float32
        arr = np.zeros((batch, d.n_kv_heads, length, d.head_dim), dtype=dtype)
        return {f"{prefix}.{i}.{k}": ort.OrtValue.ortvalue_from_numpy(arr, self.device, 0)
                for i in range(d.n_layers) for k in ("key", "value")}

    def _new_state(self, capacity: int = 0, shard: int = 0):
        """A fresh StepState; ``capacity`` (tokens per row the call may hold) sizes a fused engine's KV buffer,
        taken from shard ``shard``'s pool."""
        if self._kv_pools:
            pool = self._kv_pools[shard]
            if self.spec.kind == "seq2seq":
                return FusedSeq2SeqState(self, pool, capacity)
            return FusedDecoderState(self.sessions["decoder"], pool, capacity)
        return _OrtSeq2SeqState(self) if self.spec.kind == "seq2seq" else _OrtDecoderState(self)

    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int | None = None) -> None:
        """Push HF-named tensors: map to engine weights, reopen the touched graphs' sessions, version += 1.

        1. map and check (transpose/tied folded in; views of the learner's tensors where the layout
           allows); a bad push raises here and changes nothing,
        2. close the touched sessions, then open new ones straight from the mapped tensors (ONNX
           Runtime copies them in); closing first lets the new session reuse the old one's memory
           (no page faults, see keep_freed_memory) and halves the peak; should the open fail, the
           sessions are reopened from the held set, unchanged, and the error raised (an engine holding no
           copy reopens from its files before its first push; after one it has nothing to reopen from),
        3. copy the mapped tensors into the held set, in place, for later partial pushes (an engine holding no
           copy keeps nothing: ONNX Runtime copied them as the sessions opened).

        ``last_push_s`` times its phases: ``map`` (1 without the int8 re-quantization), ``quantize`` (an int8
        engine's :func:`quantize_push`; ~0 otherwise), ``open`` (2), ``copy`` (3); refit bench generate reports them.
        """
        t0 = time.perf_counter()
        if self.adapter is not None and any(self.adapter.owns(n) for n in named_tensors):
            adapter = {n: t for n, t in named_tensors.items() if self.adapter.owns(n)}
            base = {n: t for n, t in named_tensors.items() if n not in adapter}
            if base:  # a LoRA run pushes its adapter only; the base never changes under it
                raise RefitError(f"update_weights: a push to {self.engine_dir} carries adapter and base weights "
                                 f"together ({len(adapter)} adapter, {len(base)} base, e.g. {sorted(base)[:2]}); "
                                 "push the adapter alone (the base is the exported one)")
            moved = self.adapter.push(adapter)
            self._version = next_version(self._version, version)
            self.last_push_s = {"map": 0.0, "quantize": 0.0, "open": 0.0, "copy": time.perf_counter() - t0,
                                "adapter_bytes": float(moved)}
            return
        wmap = self.manifest.weight_map
        named = resolve_names(named_tensors, set(wmap), self.manifest.tied)
        if self._push_via == "file":
            return self._push_through_files(named, version, t0)
        mapped = engine_weights(named, wmap, self._weight_dtype)
        t1 = time.perf_counter()
        mapped = quantize_push(mapped, self.manifest.quantization)  # int8: the twins and scales
        t2 = time.perf_counter()
        for g, new in mapped.items():
            for name, t in new.items():
                self._check_shape(g, name, t)
            if self.weights is None:
                self._check_complete(g, new)
        for g in mapped:
            del self.sessions[g]
        try:
            self.sessions.update(self._open(mapped))
        except Exception as e:
            if self.weights is None and self._version > 0:  # the files hold step-0 weights, no copy of the pushed
                why = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                raise RefitError(f"update_weights: opening the pushed graphs {sorted(mapped)} failed ({why}) and the "
                                 f"engine over {self.engine_dir} holds no copy of its weights (version "
                                 f"{self._version}) to reopen them with; restart from the last checkpoint") from None
            self.sessions.update(self._open({g: {} for g in mapped}))
            raise
        t3 = time.perf_counter()
        sources = {t.untyped_storage().data_ptr() for t in named.values()}
        with one_thread():  # 148 memcpys: a second OpenMP thread only adds wake-ups (see one_thread)
            # not held: ONNX Runtime copied the pushed tensors as the sessions opened, nothing to keep
            for g, new in (mapped.items() if self.weights is not None else ()):
                held = self.weights[g]
                for name, t in new.items():
                    if t.untyped_storage().data_ptr() in sources:
                        held[name].copy_(t)  # the learner's memory: snapshot it into our buffer
                    else:
                        held[name] = t  # already a fresh tensor of ours (a transposed copy)
        self._version = next_version(self._version, version)
        t4 = time.perf_counter()
        self.last_push_s = {"map": t1 - t0, "quantize": t2 - t1, "open": t3 - t2, "copy": t4 - t3}

    def _check_shape(self, graph: str, name: str, t: torch.Tensor) -> None:
        want = self._shapes[graph].get(name)
        if want != tuple(t.shape):
            raise RefitError(f"update_weights: engine weight {graph}:{name} expects {want}, got {tuple(t.shape)}")

    def _check_complete(self, graph: str, names) -> None:
        """An engine holding no copy of its weights takes a push only with every weight of each graph it touches."""
        missing = sorted(set(self._shapes[graph]) - set(names))
        if missing:
            raise RefitError(f"update_weights: the engine over {self.engine_dir} holds no copy of its weights "
                             f"(hold_weights=False), so a push must carry every weight of each graph it touches; this "
                             f"one leaves out {len(missing)} of graph {graph!r}'s {len(self._shapes[graph])}, e.g. "
                             f"{missing[:3]} (push the whole model, or open the engine with hold_weights=True)")

    def _push_through_files(self, named: dict[str, torch.Tensor], version: int | None, t0: float) -> None:
        """``push_via="file"``: each touched graph written (one mapped tensor at a time, shapes checked as they are
        written) to ``<scratch>/<graph>.v<N>.onnx`` + ``.data``; then its session closed and reopened from them; the
        previous pair removed. A bad push raises before any session is closed and leaves no file behind."""
        views = engine_weight_views(named, self.manifest.weight_map, self._weight_dtype)
        for g, view in views.items():
            self._check_complete(g, view)
        if self._scratch is None:
            self._scratch = push_scratch(self.engine_dir)
        new_version = next_version(self._version, version)
        written = write_pushed_graphs({g: self.engine_dir / self._graph_src[g] for g in views}, views, self._scratch,
                                      new_version, self._check_shape)
        t1 = time.perf_counter()
        before = {g: self._files[g] for g in written}
        for g in written:
            del self.sessions[g]
        try:
            for g, path in written.items():
                self._files[g] = str(path)
            self.sessions.update(self._open({g: {} for g in written}))
        except Exception:
            self._files.update(before)
            self.sessions.update(self._open({g: {} for g in written}))
            raise
        for old in before.values():
            if Path(old).parent == self._scratch:  # an earlier push's pair, not the engine folder's own files
                remove_graph_pair(Path(old))
        self._version = new_version
        self.last_push_s = {"map": 0.0, "quantize": 0.0, "write": t1 - t0, "open": time.perf_counter() - t1,
                            "copy": 0.0}

    def close(self) -> None:
        self.sessions, self.weights, self._kv_pools = {}, {}, []  # the sessions first: they map the scratch files
        if self._scratch is not None:
            import shutil

            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
