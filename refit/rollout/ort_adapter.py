"""The LoRA adapter of a LoRA-ready ONNX Runtime engine (refit/export/lora.py): bound inputs, pushed in place.

A LoRA-ready graph has, per target layer ``m``, two optional inputs ``lora.<m>.A`` (K, r) and ``lora.<m>.B``
(r, N) whose defaults are empty: unbound, the layer computes the base exactly. :class:`AdapterSlots` holds the
engine's adapter as numpy buffers with an ``OrtValue`` over each; :class:`BoundSession` binds them into every
IOBinding a session makes, so the decode loop, the fused KV-buffer states and the step bindings run the adapter
without knowing it. A push copies the new matrices into the same buffers (a change of rank allocates new ones):
no session is reopened, the base's weights are never touched, and the bytes moved are the adapter's only.

The engine's reference view (``OrtEngine.adapter_off``) runs the same sessions unbound: the base, one copy of it.

Thread safety: ONNX Runtime reads bound inputs when a run starts and while it runs; the PPO loop pushes between
generations (overlapped: on the engine's own thread, queued behind the generation in flight), never during one.
"""

from __future__ import annotations

import math
from collections.abc import MutableMapping

import numpy as np
import torch

from refit.core.errors import RefitError
from refit.core.manifest_sections import Lora, lora_inputs, lora_push_names


class AdapterSlots:
    """The engine's adapter: ``{input name: numpy buffer}`` and the ``OrtValue`` s over them, by graph."""

    def __init__(self, lora: Lora, dtype: np.dtype):
        self.lora, self.dtype = lora, np.dtype(dtype)
        self._by_push_name: dict[str, tuple[str, str, int]] = {}  # push name -> (module, input name, 0 A | 1 B)
        for m in lora.targets:
            for i, (push, inp) in enumerate(zip(lora_push_names(m), lora_inputs(m))):
                self._by_push_name[push] = (m, inp, i)
        self.arrays: dict[str, np.ndarray] = {}
        self.values: dict[str, dict[str, object]] = {g: {} for t in lora.targets.values() for g in t.graphs}
        self.rank: dict[str, int] = {}  # module -> the rank bound (absent: unbound, off)

    def owns(self, name: str) -> bool:
        return name in self._by_push_name

    def push(self, named: dict[str, torch.Tensor]) -> int:
        """Bind ``{<module>.lora_A: (r, K), <module>.lora_B: (N, r) already scaled}`` (see refit.core.manifest_sections'
        ``lora_push_names``); modules not named keep what they had. Checked before anything changes (one
        RefitError line). A module pushed with r = 0 is unbound (off). Returns the bytes copied."""
        import onnxruntime as ort

        pairs: dict[str, dict[int, torch.Tensor]] = {}
        for name, t in named.items():
            module, _, i = self._by_push_name[name]
            pairs.setdefault(module, {})[i] = t
        staged = []
        for module, ab in pairs.items():
            if len(ab) != 2:
                raise RefitError(f"update_weights: adapter of {module} pushed with only its "
                                 f"{'lora_A' if 0 in ab else 'lora_B'}; a push carries both matrices of a layer")
            a, b = ab[0], ab[1]
            tgt = self.lora.targets[module]
            r = a.shape[0] if a.dim() == 2 else -1
            if a.dim() != 2 or b.dim() != 2 or a.shape[1] != tgt.in_features or tuple(b.shape) != (tgt.out_features, r):
                raise RefitError(f"update_weights: adapter of {module} has lora_A {tuple(a.shape)} and lora_B "
                                 f"{tuple(b.shape)}; this engine's layer takes (r, {tgt.in_features}) and "
                                 f"({tgt.out_features}, r)")
            # numpy views (no copy for fp32 CPU tensors); numpy's single-threaded sum: torch's per-tensor OpenMP
            # wake-ups cost more than the sums on a busy machine (refit/rollout/sampling.py one_thread)
            a = a.detach().to(torch.float32).cpu().numpy()
            b = b.detach().to(torch.float32).cpu().numpy()
            if not (math.isfinite(float(a.sum(dtype=np.float64))) and math.isfinite(float(b.sum(dtype=np.float64)))):
                raise RefitError(f"update_weights: adapter of {module} holds NaN or inf values; not pushed")
            staged.append((module, a, b, r))
        moved = 0
        for module, a, b, r in staged:
            a_in, b_in = lora_inputs(module)
            if r == 0:
                for g in self.lora.targets[module].graphs:
                    self.values[g].pop(a_in, None)
                    self.values[g].pop(b_in, None)
                self.arrays.pop(a_in, None)  # a later push allocates and binds afresh
                self.arrays.pop(b_in, None)
                self.rank.pop(module, None)
                continue
            for inp, src in ((a_in, a.T), (b_in, b.T)):  # A^T (K, r), (s B)^T (r, N): views
                buf = self.arrays.get(inp)
                if buf is not None and buf.shape == src.shape:
                    np.copyto(buf, src)  # in place: the OrtValue over it stays bound
                else:
                    buf = self.arrays[inp] = np.ascontiguousarray(src, dtype=self.dtype)
                    val = ort.OrtValue.ortvalue_from_numpy(buf)
                    for g in self.lora.targets[module].graphs:
                        self.values[g][inp] = val
                moved += buf.nbytes
            self.rank[module] = r
        return moved


class BoundSession:
    """An ``InferenceSession`` whose IO bindings start with ``values`` bound (the adapter's inputs of its graph)."""

    def __init__(self, sess, values: dict):
        self._sess, self._values = sess, values

    def io_binding(self):
        io = self._sess.io_binding()
        for name, val in self._values.items():
            io.bind_ortvalue_input(name, val)
        return io

    def run(self, output_names, input_feed, run_options=None):
        return self._sess.run(output_names, {**self._values, **input_feed}, run_options)

    def __getattr__(self, name):  # run_with_iobinding, get_inputs, get_outputs, ...: the session's own
        return getattr(self._sess, name)


class AdapterSessions(MutableMapping):
    """The engine's ``{graph: session}``, each handed out as a :class:`BoundSession` over the adapter's values; the
    raw sessions are the ones stored (a weight push of the base replaces them here)."""

    def __init__(self, raw: dict, slots: AdapterSlots):
        self.raw, self.slots = raw, slots

    def __getitem__(self, graph: str):
        values = self.slots.values.get(graph)
        return BoundSession(self.raw[graph], values) if values else self.raw[graph]

    def __setitem__(self, graph: str, sess) -> None:
        self.raw[graph] = sess

    def __delitem__(self, graph: str) -> None:
        del self.raw[graph]

    def __iter__(self):
        return iter(self.raw)

    def __len__(self) -> int:
        return len(self.raw)
