"""The engine folder's manifest: the typed record every backend reads, checked, in one place.

``manifest.json`` is the contract between the exporter and every backend (ONNX Runtime, TensorRT, the parity gate, the
TensorRT checks): model geometry, special ids, the padding rule, the graphs and their I/O names, the HF -> engine weight
map, tied aliases, the shape profiles, hashes, export options, library versions, the parity record and, once built, the
TensorRT plans. :class:`Manifest` is that record. It is read (:meth:`Manifest.read`), written (:meth:`Manifest.write`,
atomically) and converted (:meth:`Manifest.from_dict`, :meth:`Manifest.to_dict`) here and nowhere else; code elsewhere
reads its fields.

On disk the layout is unchanged (``FORMAT = "refit-engine/1"``): engine folders exported before this record existed load
as they are, and ``to_dict()`` gives back exactly the JSON read.

Unknown keys. Inside a known section (``dims``, a graph, a weight-map entry, a TensorRT plan, ...) an unknown or missing
key is an error, in one line: a misspelt or half-written manifest fails where it is read, not as a KeyError deep inside
a backend. Unknown *top-level* sections are preserved deliberately in :attr:`Manifest.extra` and written back verbatim:
an exporter that adds a section within the same format (a newer Refit, another branch's exporter) still produces a
folder this one can run, and ``build_engines`` rewriting the manifest does not drop the section. No code reads
``extra``; a reader that needs a section adds a typed field for it here.

:meth:`Manifest.check` validates what the types cannot: the kind and its graphs, positive dims, a 1:1 weight map into
existing graphs, tied aliases, every graph input covered by every shape profile, TensorRT plans that match the graphs
and profiles. :meth:`Manifest.read` runs it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

from refit.core.errors import RefitError
from refit.core.records import OMIT_IF_NONE, LayoutError, build_record, plain, read_json

MANIFEST = "manifest.json"  # file name inside an engine folder
FUSED_INPUTS = frozenset({"seqlens_k", "query_seqlens"})  # graph inputs only a fused-attention decoder has
FORMAT = "refit-engine/1"  # on-disk layout; bump when a reader of the old one would misread the new
KINDS = ("decoder", "seq2seq")
GRAPHS_OF_KIND = {"decoder": ("decoder",), "seq2seq": ("encoder", "decoder")}
DTYPES = ("fp32", "fp16", "bf16")
SIDES = ("left", "right")
TRANSFORMS = ("identity", "transpose", "affine")  # HF tensor -> the tensor the engine stores



# ------------------------------------------------------------------------------- records

@dataclass(frozen=True)
class Dims:
    """Model geometry and the engine's size limits."""

    vocab_size: int  # V: width of the logits (B, K, V); rows of the input embedding
    n_layers: int  # L: decoder layers; 2L past K/V inputs past.{i}.key|value
    n_kv_heads: int  # H_kv: axis 1 of every K/V tensor (B, H_kv, T, D)
    head_dim: int  # D: axis 3 of every K/V tensor
    max_positions: int | None  # learned position table size; None for relative/rotary-only models
    max_batch: int  # most rows per call: axis-0 max of every shape profile
    max_len: int  # most prompt + response tokens per row: the profiles' length max


@dataclass(frozen=True)
class SpecialIds:
    pad: int  # fills padded prompt and response positions
    eos: int  # ends a response
    decoder_start: int | None  # seq2seq: the decoder's first input token; None for decoder-only


@dataclass(frozen=True)
class Padding:
    """The padding rule, stated once for every backend (core/padding.py implements it)."""

    prompt_side: str  # "left" (decoder-only) or the encoder's native side ("right" for T5)
    position_ids: str  # how position ids follow from the mask, in words
    response_side: str  # "right": responses are padded after their last token
    rule: str  # the rule in words


@dataclass(frozen=True)
class GraphSpec:
    """One ONNX graph of the folder (``decoder``; plus ``encoder`` for seq2seq)."""

    file: str  # "<graph>.onnx", relative to the engine folder
    data: str  # "<graph>.onnx.data": the external (refittable) weights, 64-byte aligned
    inputs: tuple[str, ...]  # input names in graph order (TensorRT profiles cover each)
    outputs: tuple[str, ...]  # output names in graph order; "logits" or "encoder_hidden_states" first
    sha256: str  # of the .onnx file (TensorRT plans record it to detect a stale plan)
    weights_sha256: str  # of the .onnx.data file as exported


@dataclass(frozen=True)
class WeightTarget:
    """Where one HF tensor lives in an engine graph."""

    engine: str  # ONNX initializer name, which is also the TensorRT refit name
    graph: str  # the graph holding it (a key of Manifest.graphs)
    transform: str  # "identity" | "transpose" | "affine" (scale * w + shift): HF tensor -> stored tensor
    # "affine" only: the exporter folded an elementwise transform of the weight into the graph (Gemma's
    # RMSNorm stores 1 + w); a push writes scale * w + shift, computed in stored_dtype
    scale: float | None = field(default=None, metadata=OMIT_IF_NONE)
    shift: float | None = field(default=None, metadata=OMIT_IF_NONE)
    stored_dtype: str | None = field(default=None, metadata=OMIT_IF_NONE)  # "fp32"|"fp16"|"bf16"; None: the engine's


@dataclass(frozen=True)
class ShapeRange:
    """One input's shape range in a TensorRT optimization profile; each tuple has the input's rank."""

    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]


@dataclass(frozen=True)
class Hashes:
    hf_weights_sha256: str  # of the source checkpoint's weight files + config.json (export cache, reuse)
    graphs_sha256: Mapping[str, str]  # {graph: sha256 of .onnx}, as in GraphSpec.sha256
    engine_weights_sha256: Mapping[str, str]  # {graph: sha256 of .onnx.data}, as in GraphSpec.weights_sha256
    # {file under tokenizer/: its sha256}: the engine's own tokenizer (absent in folders exported before it)
    tokenizer_sha256: Mapping[str, str] | None = field(default=None, metadata=OMIT_IF_NONE)


@dataclass(frozen=True)
class Parity:
    """The parity gate's record (rollout/parity.py): engine vs PyTorch on padded prompts."""

    max_abs_logit_diff: float  # max |engine - torch| over real rows and generated positions
    max_abs_logprob_diff: float  # the same on log-probs: the gated quantity
    tolerance_logprob: float  # the gate's threshold for this dtype
    prompts: int  # rows in the gate's batch
    prompt_lengths: tuple[int, ...]  # unpadded length of each (several lengths: padding is exercised)
    decode_steps: int  # cached single-token steps after the prefill
    padding_side: str  # the prompt side the gate padded on
    reference: str  # what the engine was compared with
    # the engine dtype's gate (export/precision.py): the PyTorch reference's dtype (the engine's own: the
    # same rounded weights, activations rounded as PyTorch's kernels round them), and how the engine's graph
    # ran (the CPU provider as is, or a bf16 graph's CPU twin); None in folders exported before the fields
    reference_dtype: str | None = field(default=None, metadata=OMIT_IF_NONE)
    engine_run: str | None = field(default=None, metadata=OMIT_IF_NONE)


@dataclass(frozen=True)
class Capabilities:
    """What the exporter found in the checkpoint from its config and a probe (export/capabilities.py)."""

    kind: str  # "decoder" | "seq2seq"
    positions: str  # "rotary" | "learned" | "sinusoidal" | "relative" | "none"
    position_offset: int  # rows of a learned table before position 0 (BART, OPT: 2)
    rotary_fraction: float | None  # share of each head's dims that rotate (GPT-NeoX 0.25, Phi 0.5)
    embed_scale: float  # factor on token embeddings (Marian: sqrt(d_model)); 1.0 when none
    tied_head: bool  # lm_head shares the input embedding
    final_logits_bias: bool  # a logits bias buffer that the weight map carries (BART, Marian)
    n_heads: int  # query heads
    n_kv_heads: int  # KV heads in the cache (< n_heads: grouped-query attention)
    head_dim: int
    n_layers: int  # decoder self-attention cache layers
    hidden_size: int  # width of the (encoder) hidden states
    sliding_window: int | None  # attention window; the engine keeps a full cache and HF's mask
    logits_to_keep: bool  # forward takes logits_to_keep (else the wrapper picks the rows itself)
    padding_side: str  # prompt / encoder input padding side, verified by the padding probe
    decoder_start_id: int | None  # seq2seq: first decoder token


@dataclass(frozen=True)
class TrtDevice:
    name: str  # GPU name the plan was built on
    compute_capability: str  # "major.minor"; a plan only runs on this architecture


@dataclass(frozen=True)
class TrtPlan:
    """One graph's refittable TensorRT plan (rollout/tensorrt/build.py)."""

    plan: str  # "<graph>.plan", relative to the engine folder
    profiles: tuple[str, ...]  # optimization profile names, in the plan's profile order
    trt_version: str  # TensorRT that built it; another version cannot load it
    precision: str  # builder precision chosen for the manifest dtype
    device: TrtDevice
    graph_sha256: str  # sha256 of the .onnx the plan was built from (stale when it differs)
    plan_bytes: int
    build_seconds: float
    refittable_weights: tuple[str, ...]  # every weight name the Refitter can set
    not_refittable: tuple[str, ...]  # mapped weights TensorRT constant-folded: a push to them fails


@dataclass(frozen=True)
class LoraTarget:
    """One linear layer that takes a LoRA adapter in the engine (export/lora.py): ``y = x W^T + (x A^T)(s B^T)``."""

    graphs: tuple[str, ...]  # the graphs whose matmul by this layer's weight got the adapter branch
    in_features: int  # K: rows of the bound A input (K, r)
    out_features: int  # N: columns of the bound B input (r, N)


@dataclass(frozen=True)
class Lora:
    """A LoRA-ready engine's record (export/lora.py): which layers take an adapter, and under what input names.

    Each target ``m`` has two optional graph inputs, ``lora.<m>.A`` (K, r) and ``lora.<m>.B`` (r, N), whose
    defaults are empty (r = 0): a run that binds nothing computes the base exactly (the adapter is off). A push
    binds ``A^T`` and ``scaling * B^T`` of PEFT's ``lora_A`` (r, K) and ``lora_B`` (N, r); the rank is any r."""

    target_modules: tuple[str, ...]  # as asked (PEFT's spelling: "all-linear" or module names)
    targets: Mapping[str, LoraTarget]  # {HF module name: its layer}


def lora_inputs(module: str) -> tuple[str, str]:
    """The engine's input names of ``module``'s adapter: (A (K, r), B (r, N))."""
    return f"lora.{module}.A", f"lora.{module}.B"


def lora_push_names(module: str) -> tuple[str, str]:
    """The names a push carries ``module``'s adapter under: PEFT's ``lora_A`` (r, K) and ``scaling * lora_B`` (N, r)."""
    return f"{module}.lora_A", f"{module}.lora_B"


@dataclass(frozen=True)
class QuantizedWeight:
    """The int8 twin of one mapped fp32 engine weight (export/quantize.py): what a push re-quantizes."""

    weight: str  # int8 initializer (K, N): round(w / scale) in [-127, 127], one scale per output column
    scale: str  # float32 initializer (N,): max |w[:, n]| / 127
    layout: str  # "kn" (MatMul/Gemm B as stored) | "nk" (Gemm transB=1: the fp32 weight is stored (N, K))
    keep_float: bool  # the fp32 weight still feeds another node (a tied embedding's Gather) and stays


@dataclass(frozen=True)
class Quantization:
    """An int8 engine's record (export/quantize.py): its scheme, its twins, its gate and its gap to fp32."""

    scheme: str  # "int8": per-column symmetric int8 weights x per-row symmetric int8 activations, MatMulInteger;
    # "int8-qdq" (TensorRT): the same int8 weights through DequantizeLinear (scale per output column), fp32 matmuls
    weights: Mapping[str, Mapping[str, QuantizedWeight]]  # {graph: {fp32 engine weight name: its twin}}
    quantized_matmuls: int  # graph nodes that run in int8
    float_matmuls: int  # weight matmuls left in fp32 (no Linear/Conv1D reference for them)
    reference: str  # what the gate compared with (a PyTorch forward of the same quantized weights)
    max_abs_logprob_diff: float  # engine vs that reference: the gated quantity (max over positions and vocab)
    tolerance_logprob: float  # 2 x the rounding floor's max, at least 1e-3 (int8-qdq: 1e-4, no floor to measure)
    # int8 engine vs the fp32 PyTorch forward on the parity prompts: a property of the engine, not a failure
    gap_vs_fp32: Mapping[str, float]
    # the reference against itself, its matmul inputs perturbed by 1e-6 relative: how far int8 rounding alone moves
    # the log-probs on these prompts ({"max_abs_logprob", "mean_abs_logprob"})
    rounding_floor: Mapping[str, float] = field(default_factory=dict)
    mean_abs_logprob_diff: float = 0.0  # engine vs reference, mean: gated too ...
    tolerance_mean: float = 0.0  # ... at 2 x the floor's mean, at least 1e-4


Profiles = Mapping[str, Mapping[str, Mapping[str, ShapeRange]]]  # {graph: {profile: {input: range}}}


@dataclass(frozen=True)
class Manifest:
    """An engine folder's ``manifest.json``. Mappings are the record's own: read them, do not change them."""

    backend: str  # the graphs' format: "onnx" in every engine folder (the engine that runs them: options.backend)
    model_type: str  # HF config.model_type ("gpt2", "llama", "t5", ...)
    architecture: str  # HF class, e.g. "GPT2LMHeadModel"
    kind: str  # "decoder" | "seq2seq"
    dtype: str  # "fp32" | "fp16" | "bf16": weights and activations of the engine
    opset: int  # ONNX default-domain opset of the graphs
    source_model: str  # absolute path of the HF checkpoint exported (may not exist on this machine)
    padding: Padding
    special_ids: SpecialIds
    dims: Dims
    graphs: Mapping[str, GraphSpec]  # {"decoder": ..., "encoder": ... (seq2seq)}
    dynamic_dims: Mapping[str, str]  # {dim name used in the graphs' shapes: meaning}
    profiles: Profiles  # {graph: {"prefill"|"decode"|"encode": {input: ShapeRange}}}, in profile order
    weight_map: Mapping[str, tuple[WeightTarget, ...]]  # {canonical HF name: its engine weights}
    tied: Mapping[str, str]  # {HF alias: canonical HF name}; aliases are not in weight_map
    hashes: Hashes
    cache_key: str  # sha256 of (weights, options, exporter version): an export is reused when equal
    options: Mapping[str, object]  # ExportOptions as exported (asdict), kept as written: older option sets load
    versions: Mapping[str, str]  # {library: version} at export time
    trace_seconds: float  # tracing + writing the graphs, before the parity gate
    capabilities: Capabilities | None = field(default=None, metadata=OMIT_IF_NONE)  # the probe's findings
    parity: Parity | None = field(default=None, metadata=OMIT_IF_NONE)  # added once the gate passed
    export_seconds: float | None = field(default=None, metadata=OMIT_IF_NONE)  # whole export, gate included
    # the exporting process's peak resident size (MB, its high-water mark by the end of the export; export/memory.py)
    export_peak_rss_mb: int | None = field(default=None, metadata=OMIT_IF_NONE)
    tensorrt: Mapping[str, TrtPlan] | None = field(default=None, metadata=OMIT_IF_NONE)  # {graph: plan} once built
    # decoder attention (export/fused.py): "fused" = GroupQueryAttention over a preallocated KV buffer
    # (graph inputs seqlens_k/query_seqlens, compact rows); "plain" or None (folders exported before
    # the field existed) = standard ops, concatenated cache, attention_mask input
    attention: str | None = field(default=None, metadata=OMIT_IF_NONE)
    attention_reason: str | None = field(default=None, metadata=OMIT_IF_NONE)  # why this attention was chosen
    # {graph: {initializer: what it is}}: float initializers that no weight feeds, e.g. a rotary
    # ``inv_freq`` buffer or a folded scale; constants of the graph that training never changes
    # (export/weight_map.py decides by provenance: no HF parameter reaches them)
    constants: Mapping[str, Mapping[str, str]] | None = field(default=None, metadata=OMIT_IF_NONE)
    # int8 rollout engine (export/quantize.py; ExportOptions.quantize): its linear layers' int8 twins; None: fp32
    quantization: Quantization | None = field(default=None, metadata=OMIT_IF_NONE)
    # LoRA-ready engine (export/lora.py; ExportOptions.lora): the layers that take an adapter; None: none do
    lora: Lora | None = field(default=None, metadata=OMIT_IF_NONE)
    extra: Mapping[str, object] = field(default_factory=dict)  # unknown top-level sections, kept verbatim

    # ---------------------------------------------------------------------- file

    @classmethod
    def read(cls, engine_dir: str | Path, check: bool = True) -> "Manifest":
        """The manifest of ``engine_dir``; RefitError (one line) when it is not a usable engine folder.

        ``check=False`` skips :meth:`check` (the layout is still parsed strictly), for a caller that
        lists every problem itself (``python -m refit.rollout.tensorrt.check``).
        """
        engine_dir = Path(engine_dir)
        f = engine_dir / MANIFEST
        if not engine_dir.is_dir():
            raise RefitError(f"engine folder {engine_dir} does not exist")
        if not f.exists():
            raise RefitError(f"{engine_dir} is not a Refit engine folder: no {MANIFEST} (run `refit export` first)")
        m = cls.from_dict(read_json(f, "is corrupt"), where=str(f))
        if check:
            m.check(where=str(f))
        return m

    def write(self, engine_dir: str | Path) -> Path:
        """Check, then write ``engine_dir/manifest.json`` atomically (temp file + ``os.replace``); its path."""
        self.check()
        f = Path(engine_dir) / MANIFEST
        tmp = f.with_name(f".{MANIFEST}.tmp-{os.getpid()}")
        try:
            with open(tmp, "w") as out:
                out.write(json.dumps(self.to_dict(), indent=1))
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, f)
        finally:
            tmp.unlink(missing_ok=True)
        return f

    # ---------------------------------------------------------------------- dict

    @classmethod
    def from_dict(cls, raw: object, where: str = "manifest") -> "Manifest":
        """Parse the JSON layout; a wrong format, missing or unknown key or wrong type is one RefitError line.

        Only the layout is checked here; :meth:`check` checks the content.
        """
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            got = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
            raise RefitError(f"{where} has format {got!r}, this Refit reads {FORMAT!r}")
        known = {f.name for f in fields(cls)} - {"extra"}
        body = {k: v for k, v in raw.items() if k in known}
        extra = {k: v for k, v in raw.items() if k not in known and k != "format"}
        try:
            return build_record(cls, body, "", fixed={"extra": extra})
        except LayoutError as e:
            raise RefitError(f"{where}: {e}") from None

    def to_dict(self) -> dict:
        """The JSON layout: ``format`` first, the fields in order, then the preserved ``extra`` sections."""
        out = {"format": FORMAT, **plain(self)}
        del out["extra"]
        out.update(self.extra)
        return out

    # ---------------------------------------------------------------------- check

    def problems(self) -> list[str]:
        """Everything inconsistent in this manifest, one line each; empty when it is usable."""
        return (_scalar_problems(self) + _capability_problems(self) + _graph_problems(self)
                + _weight_map_problems(self) + _profile_problems(self) + _plan_problems(self) + _lora_problems(self))

    def check(self, where: str = "manifest") -> None:
        """Raise RefitError (one line: the first problem, and how many more) unless :meth:`problems` is empty."""
        found = self.problems()
        if found:
            more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
            raise RefitError(f"{where} is inconsistent: {found[0]}{more}")


# ------------------------------------------------------------------------------- checks

def _scalar_problems(m: Manifest) -> list[str]:
    p = []
    if m.kind not in KINDS:
        p.append(f"kind {m.kind!r} is not one of {', '.join(KINDS)}")
    if m.dtype not in DTYPES:
        p.append(f"dtype {m.dtype!r} is not one of {', '.join(DTYPES)}")
    if m.padding.prompt_side not in SIDES:
        p.append(f"padding.prompt_side {m.padding.prompt_side!r} is not left or right")
    for f in fields(Dims):
        v = getattr(m.dims, f.name)
        if not (v is None and f.name == "max_positions") and v <= 0:
            p.append(f"dims.{f.name} is {v}, must be positive")
    for name in ("pad", "eos"):
        if getattr(m.special_ids, name) < 0:
            p.append(f"special_ids.{name} is negative")
    if m.export_peak_rss_mb is not None and m.export_peak_rss_mb <= 0:
        p.append(f"export_peak_rss_mb is {m.export_peak_rss_mb}, must be positive")
    if m.attention not in (None, "plain", "fused"):
        p.append(f"attention {m.attention!r} is not plain or fused")
    elif m.kind == "decoder" and "decoder" in m.graphs:
        fused_inputs = FUSED_INPUTS & set(m.graphs["decoder"].inputs)
        if (m.attention == "fused") != bool(fused_inputs):  # absent (older folders) reads as plain
            said = repr(m.attention) if m.attention else "absent (read as plain)"
            graph = f"fused ({', '.join(sorted(fused_inputs))} inputs)" if fused_inputs else "plain (no seqlens_k input)"
            p.append(f"attention is {said} but the decoder graph is {graph}")
    if m.kind == "seq2seq" and m.special_ids.decoder_start is None:
        p.append("special_ids.decoder_start is null, a seq2seq engine needs it")
    return p


def _capability_problems(m: Manifest) -> list[str]:
    """The probe's record (absent in folders exported before it) agrees with the geometry the engines use."""
    c = m.capabilities
    if c is None:
        return []
    pairs = [("kind", c.kind, m.kind), ("n_layers", c.n_layers, m.dims.n_layers),
             ("n_kv_heads", c.n_kv_heads, m.dims.n_kv_heads), ("head_dim", c.head_dim, m.dims.head_dim),
             ("padding_side", c.padding_side, m.padding.prompt_side),
             ("decoder_start_id", c.decoder_start_id, m.special_ids.decoder_start)]
    return [f"capabilities.{name} is {a!r}, the manifest says {b!r}" for name, a, b in pairs if a != b]


def _graph_problems(m: Manifest) -> list[str]:
    p = []
    want = GRAPHS_OF_KIND.get(m.kind)
    if want is not None and sorted(m.graphs) != sorted(want):
        p.append(f"a {m.kind} engine has graphs {list(want)}, this one {list(m.graphs)}")
    for g, spec in m.graphs.items():
        if not spec.inputs or not spec.outputs:
            p.append(f"graph {g} lists no inputs or no outputs")
        if m.hashes.graphs_sha256.get(g) != spec.sha256 or m.hashes.engine_weights_sha256.get(g) != spec.weights_sha256:
            p.append(f"hashes of graph {g} differ from graphs.{g}")
    p += [f"hashes name graph {g}, which is not in graphs" for g in
          sorted((set(m.hashes.graphs_sha256) | set(m.hashes.engine_weights_sha256)) - set(m.graphs))]
    return p


def _weight_map_problems(m: Manifest) -> list[str]:
    """1:1: every HF tensor feeds >= 1 engine weight of an existing graph, every engine weight has one owner."""
    p, owners = [], {}
    for hf_name, targets in m.weight_map.items():
        if not targets:
            p.append(f"weight map: {hf_name} feeds no engine weight")
        for t in targets:
            if t.graph not in m.graphs:
                p.append(f"weight map: {hf_name} -> {t.graph}:{t.engine} names no graph of this manifest")
            if t.transform not in TRANSFORMS:
                p.append(f"weight map: {hf_name} -> {t.graph}:{t.engine} has unknown transform {t.transform!r}")
            elif (t.transform == "affine") != (t.scale is not None and t.shift is not None):
                p.append(f"weight map: {hf_name} -> {t.graph}:{t.engine}: scale and shift go with transform affine")
            if t.stored_dtype is not None and t.stored_dtype not in DTYPES:
                p.append(f"weight map: {hf_name} -> {t.graph}:{t.engine} has unknown stored_dtype {t.stored_dtype!r}")
            first = owners.setdefault((t.graph, t.engine), hf_name)
            if first != hf_name:
                p.append(f"weight map: engine weight {t.graph}:{t.engine} is fed by both {first} and {hf_name}")
    for alias, canon in m.tied.items():
        if alias in m.weight_map:
            p.append(f"tied: alias {alias} is also in the weight map")
        if canon not in m.weight_map:
            p.append(f"tied: {alias} -> {canon}, which is not in the weight map")
    return p


def _lora_problems(m: Manifest) -> list[str]:
    """Every adapter target names graphs of this manifest and positive widths."""
    if m.lora is None:
        return []
    p = [] if m.lora.targets else ["lora: no target layers"]
    for name, t in m.lora.targets.items():
        if not t.graphs or any(g not in m.graphs for g in t.graphs):
            p.append(f"lora: target {name} names graphs {list(t.graphs)}, not all in graphs")
        if t.in_features <= 0 or t.out_features <= 0:
            p.append(f"lora: target {name} has widths {t.in_features} x {t.out_features}, must be positive")
    return p


def _profile_problems(m: Manifest) -> list[str]:
    """Every graph has profiles, and each profile gives every input of its graph (and nothing else) a range."""
    p = [f"profiles name graph {g}, which is not in graphs" for g in m.profiles if g not in m.graphs]
    for g, spec in m.graphs.items():
        profs = m.profiles.get(g)
        if not profs:
            p.append(f"graph {g} has no shape profiles")
            continue
        for pname, prof in profs.items():
            where = f"{g}/{pname}"
            p += [f"{where}: input {x} has no min/opt/max" for x in spec.inputs if x not in prof]
            p += [f"{where}: {x!r} is not an input of graph {g}" for x in prof if x not in spec.inputs]
            for x, r in prof.items():
                if not len(r.min) == len(r.opt) == len(r.max):
                    p.append(f"{where}.{x}: min/opt/max ranks {len(r.min)}/{len(r.opt)}/{len(r.max)} differ")
                elif not all(0 <= lo <= o <= hi for lo, o, hi in zip(r.min, r.opt, r.max)):
                    p.append(f"{where}.{x}: needs 0 <= min <= opt <= max, "
                             f"got {list(r.min)}/{list(r.opt)}/{list(r.max)}")
    return p


def _plan_problems(m: Manifest) -> list[str]:
    p = []
    for g, rec in (m.tensorrt or {}).items():
        if g not in m.graphs:
            p.append(f"TensorRT plan for {g}, which is not in graphs")
        elif list(rec.profiles) != list(m.profiles.get(g, {})):
            want = list(m.profiles.get(g, {}))
            p.append(f"{g}: TensorRT profiles {list(rec.profiles)} differ from the manifest's {want}")
    return p
