"""What a batch needs in memory, estimated from the model's config before any work (issue 32 #4).

A batch that cannot fit is refused in one line with the estimate, before any export or generation, instead of
running for minutes and dying of memory. The estimate is of the largest call of each kind, in fp32 (4 bytes):

- **KV cache**: the engine's call of ``engine_rows`` rows (at most its max_batch: a larger batch runs within it,
  refit.rollout.engine.LoopEngine) x ``max_len`` positions x 2 (K, V) x layers x kv heads x head dim;
- **engine logits**: the larger of a decode step (rows x V, three copies: logits, processed and plain log-probs)
  and a scoring chunk (rows x 64 positions x V, the logits and their log-softmax);
- **engine activations**: the engine call's prefill, rows x ``max_len`` x (2 hidden + 2 intermediate): one layer's
  residual stream and MLP width live at once (measured on tiny GPT-2, fused ONNX Runtime engine, 2000 and 8000
  rows of 14 + 8 tokens, generate then a whole-vocabulary score: 0.154 MB a row over the engine at rest; the
  three engine terms: 0.14 MB);
- **learner logits**: the learner's micro-batch (``learner_rows``) x response positions x V, twice (the logits
  and their gradient: refit.learner.losses.chunked keeps no other full-size tensor);
- **learner activations**: micro-batch x ``max_len`` x layers x (6 hidden + 4 intermediate + 2 heads x max_len)
  values kept for the backward pass (the residual stream, q, k, v, the attention output and the MLP's inputs
  and outputs, the attention scores and probabilities of eager attention);
- **weights**: the parameters (the checkpoint's size) in fp32, times ``weight_copies`` (the policy, a frozen
  copy, its gradient and Adam's two moments);
- **batch tensors**: what the step holds for the whole batch, ``BATCH_BYTES`` a position (the rollout's ids and
  masks, its log-probs, the old and reference log-probs, values, advantages, returns, rewards, KL, entropy).

It is an estimate, not a bound: allocator slack, ONNX Runtime's arenas and Python's own memory come on top, and a
fused kernel may keep less. What matters is its order: a batch whose engine calls or whole-batch tensors need
tens of GiB says so before it starts, not after minutes of generation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from refit.core.hf_folder import text_config
from refit.core.errors import RefitError

F32 = 4  # bytes per value: the learner and the engines' logits are fp32
SCORE_CHUNK = 64  # positions per scoring forward (refit.rollout.engine.DEFAULT_SCORE_CHUNK)
SCORE_ROWS = 16  # rows per scoring forward of PPO's two-pass step (refit.learner.ppo.experience.score_batch)
GiB = 2 ** 30


@dataclass(frozen=True)
class Geometry:
    """What the estimate reads of a model's config."""

    layers: int  # decoder layers
    hidden: int  # residual width
    intermediate: int  # MLP width (4 x hidden where the config has none)
    heads: int  # attention heads (the scores are (heads, T, T) per row)
    kv_dim: int  # kv heads x head dim: one position's K (or V) in one layer
    vocab: int  # logits per position
    params: int  # parameters, from the checkpoint files' size and dtype


def _first(cfg, *names, default=0):
    for n in names:
        v = getattr(cfg, n, None)
        if v:
            return int(v)
    return default


def _params(model_dir: Path, text) -> int:
    """Parameters from the checkpoint files' size (safetensors or .bin) and the config's dtype."""
    size = sum(f.stat().st_size for pat in ("*.safetensors", "*.bin") for f in model_dir.glob(pat))
    # dtype first: reading torch_dtype is deprecated in transformers 5 (a warning at each read)
    dtype = str(getattr(text, "dtype", None) or getattr(text, "torch_dtype", None) or "float32")
    return size // (2 if ("16" in dtype) else 4)


def geometry(model_dir: str | Path) -> Geometry | None:
    """The model's :class:`Geometry`; None when its config cannot be read (the job's own line says why later)."""
    text = text_config(model_dir)
    if text is None or not getattr(text, "vocab_size", None):
        return None
    hidden = _first(text, "hidden_size", "n_embd", "d_model")
    heads = _first(text, "num_attention_heads", "n_head", "num_heads", default=1)
    head_dim = _first(text, "head_dim", default=hidden // max(heads, 1))
    kv_heads = _first(text, "num_key_value_heads", default=heads)
    return Geometry(layers=_first(text, "num_hidden_layers", "n_layer", "num_layers", default=1), hidden=hidden,
                    intermediate=_first(text, "intermediate_size", "n_inner", "d_ff", "ffn_dim", default=4 * hidden),
                    heads=heads, kv_dim=kv_heads * head_dim, vocab=int(text.vocab_size),
                    params=_params(Path(model_dir), text))


def engine_terms(g: Geometry, engine_rows: int, max_len: int, score_rows: int | None = None) -> dict[str, int]:
    """Bytes of an engine's largest call: its KV cache, logits and prefill activations. ``score_rows``: the rows
    it scores at once (a job's reference engine scores part of the batch at a time), by default ``engine_rows``."""
    step = engine_rows * g.vocab * 3
    score = (engine_rows if score_rows is None else score_rows) * min(SCORE_CHUNK, max_len) * g.vocab * 2
    return {"KV cache": F32 * engine_rows * max_len * 2 * g.layers * g.kv_dim, "engine logits": F32 * max(step, score),
            "engine activations": F32 * engine_rows * max_len * (2 * g.hidden + 2 * g.intermediate)}


def engine_weight_bytes(g: Geometry, quantize: str = "none") -> int:
    """Bytes of an engine's weights in memory: fp32, or with ``quantize`` int8 one byte a parameter plus the
    embedding kept in fp32 for its lookup (refit/export/quantize.py quantizes the matmuls only)."""
    if quantize == "int8":
        return g.params + F32 * g.vocab * g.hidden
    return F32 * g.params


def learner_terms(g: Geometry, learner_rows: int, max_len: int, response: int, weight_copies: int) -> dict[str, int]:
    """Bytes of the learner's largest call (one micro-batch with autograd) and of its weights. The activations'
    factors (4 hidden and 11 MLP widths a layer and position, and the attention's scores) are fitted to the peaks
    that a forward and backward of PEFT's LoRA model reached at Qwen2.5-0.5B's and Qwen2.5-1.5B's full-depth
    geometries (docs/fast-by-default.md, "Micro-batches"): a SwiGLU block keeps its gate, up, activation and
    product, each MLP-wide, for backward, and the backward's temporaries are as wide again."""
    per_pos = g.layers * (4 * g.hidden + 11 * g.intermediate + 2 * g.heads * max_len)
    return {"learner logits": F32 * learner_rows * response * g.vocab * 2,
            "learner activations": F32 * learner_rows * max_len * per_pos,
            "weights": F32 * g.params * weight_copies}


BATCH_BYTES = 96  # a position of the whole batch: 4 int64 (ids, indices) and 16 fp32 (masks, log-probs, ...)


def batch_terms(rows: int, max_len: int) -> dict[str, int]:
    """Bytes of the tensors the step holds for the whole batch (rollout and experience)."""
    return {"batch tensors": BATCH_BYTES * rows * max_len}


LEARNER_BUDGET = 5 * GiB // 2  # auto micro-batches: at most this many bytes of one micro-batch's logits and activations
LEARNER_TOKENS = 4096  # ... and at most this many positions


def auto_learner_rows(g: Geometry, max_len: int, response: int, free: int | None = None) -> int:
    """Rows per learner forward with autograd (``optim.micro_batch_rows`` 0, auto): the most whose logits and
    activations (:func:`learner_terms`) fit min(``LEARNER_BUDGET``, a quarter of the ``free`` memory, by default
    :func:`available`) and whose positions are at most ``LEARNER_TOKENS``; at least 1. The update splits its
    micro-batches to this size (the loss is normalised by the minibatch's tokens, so the split changes nothing but
    memory and speed). Both caps come from measurements on a CPU, where more rows a forward took as long a row or
    longer and left glibc's kept heap larger (docs/fast-by-default.md, "Micro-batches")."""
    one = learner_terms(g, 1, max_len, response, 0)
    per_row = one["learner logits"] + one["learner activations"]
    free = available() if free is None else free
    budget = min(LEARNER_BUDGET, free // 4) if free else LEARNER_BUDGET
    return max(1, min(budget // max(per_row, 1), LEARNER_TOKENS // max(max_len, 1)))


def available() -> int | None:
    """Bytes of host memory the system can still give (``MemAvailable``); None where /proc/meminfo is absent."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def gib(n: int) -> str:
    """``n`` bytes in MiB, GiB or TiB, one decimal."""
    return (f"{n / 2 ** 20:.1f} MiB" if n < GiB else f"{n / GiB:.1f} GiB" if n < 2 ** 40
            else f"{n / 2 ** 40:.1f} TiB")


def refuse_if_over(terms: dict[str, int], have: int | None, what: str, where: str, fix: str) -> None:
    """One line when the ``terms`` (bytes) add up to more than ``have``: the estimate, its parts, the way out."""
    need = sum(terms.values())
    if have is None or need <= have:
        return
    parts = ", ".join(f"{k} {gib(v)}" for k, v in terms.items())
    raise RefitError(f"{what} needs about {gib(need)} ({parts}), more than the {gib(have)} {where} available; "
                     f"{fix}")


def release_freed_memory() -> bool:
    """Hand the pages of freed heap blocks back to the system now (glibc's ``malloc_trim(0)``, which also releases
    free pages inside the heap, not only at its top), after a one-off release of much memory (a learner's fp32 base
    replaced by its int8 twins): refit.export.graph's ``keep_freed_memory`` keeps them resident otherwise, and later
    blocks larger than the freed ones (a vocabulary-wide logits chunk) cannot reuse them, so the resident size would
    grow past them.
    Returns False where the C library is not glibc."""
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False
