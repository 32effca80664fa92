"""The int8 arithmetic of an int8 engine, in PyTorch: the contract an int8 engine and its references share.

:func:`quantize_weight` makes the int8 twin of a weight (per output column, symmetric) that the exporter writes
and every push re-quantizes (refit/export/quantize.py); :func:`int8_linear` computes a quantized matmul as the graph
does (activations per row, the integer product exact). :func:`reference_model` is a model whose quantized layers
run that arithmetic (:class:`Int8Linear`; :class:`QDQLinear` for the TensorRT Q/DQ scheme): the export's parity
gate (refit/rollout/parity.py) and the learner's push probe (refit/learner/run/sync.py) both compare an int8 engine with
it, within twice the :func:`rounding_floor` it measures. Why this scheme and what it costs: refit/export/quantize.py.
"""

from __future__ import annotations

import copy

import torch

from refit.core.manifest import Manifest

QDQ = "int8-qdq"  # Quantization.scheme of a TensorRT export: weight-only int8, DequantizeLinear into fp32 matmuls
FLOOR_JITTER = 1e-6  # relative perturbation of every quantized matmul input when measuring the rounding floor
TINY = 1e-30  # floor of a row's max |x|: an all-zero row quantizes to 0, never divides by 0
EXACT_K = 1024  # a K chunk whose int8 dot products fp32 sums exactly: 1024 * 127^2 < 2^24 in any summation order


def quantize_weight(w_kn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, N) float weight -> (q (K, N) int8 in [-127, 127], scale (N,) float32): per output column, symmetric.

    Works on the memory layout it is given (a transposed view, e.g. a Linear weight or a Gemm transB=1
    weight, is reduced along its contiguous rows, then the int8 result transposed once): the same numbers
    either way (max, one division and rounding per element), 4.7 -> ~1 s for GPT-2 small's push."""
    w = w_kn.detach().float()
    nk = not w.is_contiguous() and w.t().is_contiguous()
    if nk:
        w = w.t()  # (N, K) contiguous: reduce along rows
    axis = 1 if nk else 0
    scale = torch.maximum(w.amax(axis), w.amin(axis).neg_()).clamp_min_(TINY).div_(127.0)  # (N,)
    q = torch.div(w, scale[:, None] if nk else scale).round_().clamp_(-127, 127).to(torch.int8)
    return (q.t().contiguous() if nk else q), scale.contiguous()


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., K) activations -> (codes (..., K) float in [-127, 127], scale (..., 1)): per row, symmetric.

    The graph's ops in the graph's order: ``Div(max|x|, 127)``, ``Round(Div(x, t))`` (half to even, as ONNX)."""
    t = x.abs().amax(-1, keepdim=True).clamp_min(TINY) / 127.0
    return torch.round(x / t), t


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                jitter: torch.Generator | None = None) -> torch.Tensor:
    """The engine's int8 matmul in PyTorch: (..., K) x (K, N) int8 -> (..., N) float32, as the graph computes it.

    The integer dot products are exact: fp32 matmuls over chunks of :data:`EXACT_K` (every partial sum an integer
    under 2^24, so exact whatever order the BLAS adds in), the chunks added in float64 (|sum| <= K * 127^2 < 2^53);
    ``float()`` rounds the sum as ONNX ``Cast(int32 -> float)`` does; then ``* t`` and ``* scale`` in that order,
    then the bias. (One float64 matmul gives the same numbers at a fraction of fp32's speed.)
    ``jitter``: perturb ``x`` by :data:`FLOOR_JITTER` relative noise first (:func:`rounding_floor`)."""
    x = x.float()
    if jitter is not None:
        x = x * (1 + FLOOR_JITTER * torch.randn(x.shape, generator=jitter))
    codes, t = quantize_rows(x)
    y = exact_int_matmul(codes, q).float() * t * scale
    return y + bias if bias is not None else y


def row_scale(x: torch.Tensor) -> torch.Tensor:
    """(..., K) -> (..., 1): :func:`quantize_rows`' ``t`` (max |x| per row / 127), the same numbers from one pass of
    max and one of min instead of an ``abs`` copy (max(max x, -min x) is max |x| exactly)."""
    return torch.maximum(x.amax(-1, keepdim=True), x.amin(-1, keepdim=True).neg_()).clamp_min_(TINY).div_(127.0)


_INT_MM: bool | None = None


def fast_int8() -> bool:
    """Whether this torch multiplies int8 matrices on the CPU (``torch._int_mm``: oneDNN's VNNI/AMX kernels where the
    CPU has them), checked once on a tiny product against the exact route."""
    global _INT_MM
    if _INT_MM is None:
        try:
            a = torch.arange(-6, 6, dtype=torch.int8).reshape(3, 4)
            b = torch.arange(-10, 10, dtype=torch.int8).reshape(4, 5)
            _INT_MM = bool(torch.equal(torch._int_mm(a, b), (a.long() @ b.long()).int()))
        except (AttributeError, RuntimeError, NotImplementedError):
            _INT_MM = False
    return _INT_MM


class Int8MatmulFn(torch.autograd.Function):
    """:func:`int8_linear` by ``torch._int_mm`` (the integer products exact in int32, so the same numbers as the
    engine and as :func:`exact_int_matmul`, several times faster), with a gradient for the input: straight through the
    rounding of the activations (dL/dx = g @ (q * scale)^T), computed in int8 as the forward is (SwitchBack's rule,
    Wortsman et al. 2023): ``g * scale`` rounded per row to int8 (:func:`row_scale`), its exact product with ``q``^T,
    times the row's scale. The weight, its scale and the bias take no gradient (a frozen base). 2-D or more; CPU."""

    @staticmethod
    def forward(ctx, x, q, scale, bias):
        k, n = q.shape
        x2 = x.reshape(-1, k).float()
        ctx.save_for_backward(q, scale)
        ctx.in_dtype = x.dtype
        if x2.shape[0] == 0:
            return x.new_zeros(*x.shape[:-1], n, dtype=torch.float32)
        t = row_scale(x2)
        # float(acc) * t * scale in the graph's order; converting first is faster than an int32 * float product
        y = torch._int_mm(torch.div(x2, t).round_().to(torch.int8), q).float().mul_(t).mul_(scale)
        if bias is not None:
            y.add_(bias)
        return y.reshape(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, g):
        q, scale = ctx.saved_tensors
        k, n = q.shape
        g2 = g.reshape(-1, n).float() * scale
        if g2.shape[0] == 0:
            return g.new_zeros(*g.shape[:-1], k, dtype=ctx.in_dtype), None, None, None
        t = row_scale(g2)
        gx = torch._int_mm(g2.div_(t).round_().to(torch.int8), q.t()).float().mul_(t)
        return gx.reshape(*g.shape[:-1], k).to(ctx.in_dtype), None, None, None


def exact_int_matmul(codes: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(..., K) integer-valued float codes x (K, N) int8 -> (..., N) float64 holding the exact integer products."""
    k = codes.shape[-1]
    acc = None
    for k0 in range(0, k, EXACT_K):
        part = (codes[..., k0:k0 + EXACT_K] @ q[k0:k0 + EXACT_K].float()).double()
        acc = part if acc is None else acc.add_(part)
    return acc


class Int8Linear(torch.nn.Module):
    """A Linear / GPT-2 Conv1D replaced by :func:`int8_linear` over its quantized weight (the gate's reference).

    ``lazy``: hold no int8 twin; quantize ``w_kn`` (the model's own weight, shared) at each forward instead, so
    the reference costs no memory beyond its modules and follows the weight if it changes (the parity gate's and
    a LoRA probe's reference over a base of billions of weights: 3 GB of twins at 3B). The numbers are the same."""

    def __init__(self, w_kn: torch.Tensor, bias: torch.Tensor | None, lazy: bool = False):
        super().__init__()
        self._source = w_kn if lazy else None
        q, s = (None, None) if lazy else quantize_weight(w_kn)
        self.register_buffer("q", q)
        self.register_buffer("scale", s)
        self.bias = None if bias is None else bias.detach().float()
        self.jitter: torch.Generator | None = None  # set by rounding_floor only
        self.keep_weight = True  # keep the dequantized weight once read (False: a learner's int8 base, hold_int8)
        self._weight: tuple | None = None  # (q, q._version, scale, scale._version, weight) of the last read

    @property
    def in_features(self) -> int:
        """K, as a Linear says it (``vocab_size`` and PEFT read these without dequantizing the weight)."""
        return (self._source if self._source is not None else self.q).shape[0]

    @property
    def out_features(self) -> int:
        return (self._source if self._source is not None else self.q).shape[1]

    def twins(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, scale): the held twins, or (``lazy``) the shared weight's, quantized now."""
        return quantize_weight(self._source) if self._source is not None else (self.q, self.scale)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight as a Linear holds it, (out, in): HF code reads it (T5 reads ``wo.weight`` twice
        per feed-forward per forward, for its dtype); the forward never does. Made once and kept while ``q`` and
        ``scale`` are the same tensors, unchanged: a tensor's ``_version`` counts its in-place changes
        (``load_state_dict`` copies in place; ``.to()`` or an assignment gives a new tensor). Inference tensors
        (made under ``torch.inference_mode``) count nothing: made on each read; ``lazy``: made on each read."""
        if self._source is not None:
            return dequantize(*self.twins()).t()
        q, s, held = self.q, self.scale, self._weight
        if q.is_inference() or s.is_inference() or not self.keep_weight:
            return dequantize(q, s).t()
        if held is None or held[0] is not q or held[1] != q._version or held[2] is not s or held[3] != s._version:
            held = self._weight = (q, q._version, s, s._version, dequantize(q, s).t())
        return held[4]

    def forward(self, x):
        q, s = self.twins()
        if self.jitter is None and x.device.type == "cpu" and fast_int8():  # the same numbers, by int8 GEMMs
            return Int8MatmulFn.apply(x, q, s, self.bias).to(x.dtype)
        return int8_linear(x, q, s, self.bias, self.jitter).to(x.dtype)


class QDQLinear(torch.nn.Module):
    """A Linear / Conv1D replaced by an fp32 matmul by its dequantized weight ``q * scale`` (the Q/DQ gate's
    reference: what ``DequantizeLinear`` then ``MatMul`` / ``Gemm`` compute)."""

    def __init__(self, w_kn: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        q, s = quantize_weight(w_kn)
        self.register_buffer("w", dequantize(q, s))
        self.bias = None if bias is None else bias.detach().float()

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight as a Linear holds it, (out, in): HF code reads it (T5's ``wo.weight.dtype``)."""
        return self.w.t()

    def forward(self, x):
        y = x.float() @ self.w
        return (y + self.bias if self.bias is not None else y).to(x.dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``DequantizeLinear(q, scale, axis=1)`` of a (K, N) int8 twin: ``float(q) * scale[n]``, one fp32 rounding."""
    return q.float() * scale.float()


def module_kn(module) -> torch.Tensor | None:
    """The (K, N) weight a Linear (out, in) or Conv1D (in, out) multiplies by; None for any other module."""
    if isinstance(module, torch.nn.Linear):
        return module.weight.t()
    if any(c.__name__ == "Conv1D" for c in type(module).__mro__):  # transformers' own, or a subclass of it
        return module.weight
    return None


def matmul_modules(model, manifest: Manifest) -> dict[str, dict[str, list[str]]]:
    """{graph: {fp32 engine weight: [Linear / Conv1D module names that multiply by it]}} (tied aliases included).

    A graph matmul is quantized only where this finds its module: that module is what the reference replaces."""
    aliases: dict[str, list[str]] = {}
    for alias, canon in manifest.tied.items():
        aliases.setdefault(canon, []).append(alias)
    out: dict[str, dict[str, list[str]]] = {}
    for hf, targets in manifest.weight_map.items():
        mods = []
        for name in [hf, *aliases.get(hf, [])]:
            owner, _, leaf = name.rpartition(".")
            try:
                m = model.get_submodule(owner)
            except AttributeError:
                continue
            if hasattr(m, "base_layer"):  # a PEFT LoRA layer: the base's Linear is inside it (the adapter stays fp32)
                owner, m = f"{owner}.base_layer", m.base_layer
            if leaf == "weight" and module_kn(m) is not None:
                mods.append(owner)
        for t in targets:
            if mods and t.transform in ("identity", "transpose"):
                out.setdefault(t.graph, {})[t.engine] = mods
    return out


def reference_model(model, manifest: Manifest, share_parameters: bool = False):
    """A copy of ``model`` whose quantized matmuls run :func:`int8_linear` on the same int8 weights as the engine
    (:class:`QDQLinear`, the dequantized weights in fp32, for the TensorRT scheme). ``share_parameters``: the copy
    shares every parameter and buffer with ``model`` (only the modules are new), so it holds no fp32 copy and sees
    ``model``'s later updates; its :class:`Int8Linear` layers are then ``lazy``: no int8 twin held, the shared
    weights quantized at each forward (the same numbers)."""
    memo = {id(t): t for t in [*model.parameters(), *model.buffers()]} if share_parameters else None
    ref = copy.deepcopy(model, memo)
    quant = manifest.quantization
    layer = QDQLinear if quant is not None and quant.scheme == QDQ else Int8Linear
    for owner in quantized_owners(ref, manifest):
        m = ref.get_submodule(owner)
        set_module(ref, owner, Int8Linear(module_kn(m), m.bias, lazy=True) if share_parameters and layer is Int8Linear
                   else layer(module_kn(m), m.bias))
    return ref


def quantized_owners(model, manifest: Manifest) -> list[str]:
    """The Linear / Conv1D modules of ``model`` (names, each once) whose weights ``manifest``'s engine quantizes: what
    :func:`reference_model` and a learner's int8 base (refit.learner.run.lora.hold_int8) replace."""
    quant = manifest.quantization
    mods = matmul_modules(model, manifest)
    return sorted({o for g, twins in (quant.weights if quant else {}).items() for name in twins for o in mods[g][name]})


def set_module(root: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    """``root``'s submodule ``name`` (dotted) replaced by ``new``."""
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, new)


def rounding_floor(ref, forward, distance, seeds: int = 3) -> float:
    """max over ``seeds`` of ``distance(forward(ref) with every Int8Linear input perturbed by FLOOR_JITTER)``: how far
    the quantized function moves under fp32 rounding noise alone. ``ref`` is left unperturbed."""
    mods = [m for m in ref.modules() if isinstance(m, Int8Linear)]
    worst = 0.0
    try:
        for s in range(seeds):
            gen = torch.Generator().manual_seed(s)
            for m in mods:
                m.jitter = gen
            worst = max(worst, float(distance(forward(ref))))
    finally:
        for m in mods:
            m.jitter = None
    return worst
