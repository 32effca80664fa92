"""The manifest's sections: the typed sub-records of :class:`refit.core.manifest.Manifest`, each field commented.

Model geometry (:class:`Dims`), special ids, the padding rule, the graphs and their I/O names, where each HF tensor
lives in a graph (:class:`WeightTarget`), the shape profiles' ranges, hashes, the parity gate's record, the probe's
capabilities, TensorRT plans, the LoRA and int8 records, and the engine's input names of a LoRA adapter. They are
read and written only as parts of the manifest (:mod:`refit.core.manifest`, which also checks them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from refit.core.records import OMIT_IF_NONE


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
    """The padding rule, stated once for every backend (refit/core/padding.py implements it)."""

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
    """The parity gate's record (refit/rollout/parity.py): engine vs PyTorch on padded prompts."""

    max_abs_logit_diff: float  # max |engine - torch| over real rows and generated positions
    max_abs_logprob_diff: float  # the same on log-probs: the gated quantity
    tolerance_logprob: float  # the gate's threshold for this dtype
    prompts: int  # rows in the gate's batch
    prompt_lengths: tuple[int, ...]  # unpadded length of each (several lengths: padding is exercised)
    decode_steps: int  # cached single-token steps after the prefill
    padding_side: str  # the prompt side the gate padded on
    reference: str  # what the engine was compared with
    # the engine dtype's gate (refit/export/precision.py): the PyTorch reference's dtype (the engine's own: the
    # same rounded weights, activations rounded as PyTorch's kernels round them), and how the engine's graph
    # ran (the CPU provider as is, or a bf16 graph's CPU twin); None in folders exported before the fields
    reference_dtype: str | None = field(default=None, metadata=OMIT_IF_NONE)
    engine_run: str | None = field(default=None, metadata=OMIT_IF_NONE)


@dataclass(frozen=True)
class Capabilities:
    """What the exporter found in the checkpoint from its config and a probe (refit/export/capabilities.py)."""

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
    """One graph's refittable TensorRT plan (refit/rollout/tensorrt/build.py)."""

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
    """One linear layer that takes a LoRA adapter in the engine (refit/export/lora.py): ``y = x W^T + (x A^T)(s
    B^T)``."""

    graphs: tuple[str, ...]  # the graphs whose matmul by this layer's weight got the adapter branch
    in_features: int  # K: rows of the bound A input (K, r)
    out_features: int  # N: columns of the bound B input (r, N)


@dataclass(frozen=True)
class Lora:
    """A LoRA-ready engine's record (refit/export/lora.py): which layers take an adapter, and under what input names.

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
    """The int8 twin of one mapped fp32 engine weight (refit/export/quantize.py): what a push re-quantizes."""

    weight: str  # int8 initializer (K, N): round(w / scale) in [-127, 127], one scale per output column
    scale: str  # float32 initializer (N,): max |w[:, n]| / 127
    layout: str  # "kn" (MatMul/Gemm B as stored) | "nk" (Gemm transB=1: the fp32 weight is stored (N, K))
    keep_float: bool  # the fp32 weight still feeds another node (a tied embedding's Gather) and stays


@dataclass(frozen=True)
class Quantization:
    """An int8 engine's record (refit/export/quantize.py): its scheme, its twins, its gate and its gap to fp32."""

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
