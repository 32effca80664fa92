"""Small Hugging Face checkpoints built locally, with no hub access.

Every model and tokenizer here is written with ``save_pretrained`` to an ordinary checkpoint
folder, so tests and the default runs exercise the real ``from_pretrained`` loading code.

The tokenizer is a byte-level BPE trained with ``tokenizers`` on a corpus generated here
(digit arithmetic and sorting lines plus a short English text), so it covers any input
(byte fallback) and is small (a few hundred ids). A model may have a larger embedding than
the tokenizer (GPT-2-small keeps 50257 rows, as in the real model); the reverse is refused by
``check_tokenizer_matches``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>"]
PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3

_TEXT = (
    "Refit trains language models with reinforcement learning and distillation. "
    "Generation runs on exported inference engines while the learner stays in PyTorch. "
    "The log probability that the engine sampled with must agree with the one the learner "
    "computes, and when it cannot, the learner must know and correct for it. "
)


def task_corpus(n_lines: int = 3000, seed: int = 0) -> list[str]:
    """Lines of the embedded tasks (addition, sorting) plus plain text, for tokenizer training."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        lines.append(f"{a}+{b}={a + b}")
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(2, 8)))
        lines.append(f"sort {digits} = {''.join(sorted(digits))}")
    lines.extend(_TEXT.split(". ") * 20)
    return lines


def build_tokenizer(out_dir: str | Path | None = None, vocab_size: int = 384):
    """Train a byte-level BPE on :func:`task_corpus`; return a ``PreTrainedTokenizerFast``.

    Digits are split one per token (so arithmetic is learnable by a tiny model). When
    ``out_dir`` is given the tokenizer is saved there with ``save_pretrained``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(task_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )
    assert fast.pad_token_id == PAD_ID and fast.eos_token_id == EOS_ID, "special token ids moved"
    if out_dir is not None:
        fast.save_pretrained(str(out_dir))
    return fast


# A ChatML-style template (Qwen's markers) small enough to read: each turn is
# "<|im_start|>ROLE\nCONTENT<|im_end|>\n"; add_generation_prompt opens the assistant turn.
CHAT_SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_chat_tokenizer(out_dir: str | Path | None = None, vocab_size: int = 384):
    """:func:`build_tokenizer` plus a chat template: ``<|im_start|>`` / ``<|im_end|>`` are added as special
    tokens AFTER the BPE ids (the plain tokenizer's ids are unchanged), ``<|im_end|>`` ends a turn."""
    fast = build_tokenizer(vocab_size=vocab_size)
    fast.add_special_tokens({"additional_special_tokens": CHAT_SPECIAL_TOKENS})
    fast.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        fast.save_pretrained(str(out_dir))
    return fast


@dataclass(frozen=True)
class Geometry:
    """Size of a locally built model. ``vocab_size=None`` means: the tokenizer's size."""

    arch: str  # a family of :data:`FAMILIES`: "gpt2", "llama", ..., "t5", "bart", "marian"
    n_layer: int  # layers (encoder-decoder: of the encoder and of the decoder each)
    d_model: int
    n_head: int
    d_ff: int
    vocab_size: int | None = None
    max_positions: int = 256
    n_kv_head: int | None = None  # grouped-query attention when < n_head (llama, qwen2, mistral)
    sliding_window: int | None = None  # mistral: attention window in tokens


GEOMETRIES: dict[str, Geometry] = {
    "tiny-gpt2": Geometry("gpt2", n_layer=2, d_model=64, n_head=4, d_ff=256),
    "tiny-llama": Geometry("llama", n_layer=2, d_model=64, n_head=4, d_ff=128, n_kv_head=2),
    "tiny-t5": Geometry("t5", n_layer=2, d_model=64, n_head=4, d_ff=128),
    "small-gpt2": Geometry("gpt2", n_layer=4, d_model=128, n_head=4, d_ff=512),
    "small-t5": Geometry("t5", n_layer=3, d_model=128, n_head=4, d_ff=256),
    # GPT-2-small geometry (124M parameters) with random weights, for benchmarks.
    "gpt2-small": Geometry("gpt2", n_layer=12, d_model=768, n_head=12, d_ff=3072, vocab_size=50257, max_positions=1024),
    # A Llama of GPT-2-small's width (12 x 768, 12 heads, 4 KV heads, vocab 32000): the int8 engine against
    # CTranslate2 int8 (refit bench generate --quantize int8 --geometry llama-small).
    "llama-small": Geometry("llama", n_layer=12, d_model=768, n_head=12, d_ff=2048, n_kv_head=4, vocab_size=32000,
                            max_positions=1024),
    # T5-small geometry (60M parameters, 6 + 6 layers, 32128 tokens) with random weights, for benchmarks.
    "t5-small": Geometry("t5", n_layer=6, d_model=512, n_head=8, d_ff=2048, vocab_size=32128, max_positions=512),
    # One tiny checkpoint per further family the exporter is tested on (refit.bench.export_families).
    "tiny-qwen2": Geometry("qwen2", n_layer=2, d_model=32, n_head=4, d_ff=64, n_kv_head=2),
    # window 4 is shorter than the parity prompts, so the sliding mask is exercised (with GQA)
    "tiny-mistral": Geometry("mistral", n_layer=2, d_model=32, n_head=4, d_ff=64, n_kv_head=1, sliding_window=4),
    "tiny-neox": Geometry("gpt_neox", n_layer=2, d_model=32, n_head=4, d_ff=64),
    "tiny-phi": Geometry("phi", n_layer=2, d_model=32, n_head=4, d_ff=64),
    "tiny-opt": Geometry("opt", n_layer=2, d_model=32, n_head=4, d_ff=64),
    "tiny-bart": Geometry("bart", n_layer=2, d_model=32, n_head=4, d_ff=64),
    "tiny-marian": Geometry("marian", n_layer=2, d_model=32, n_head=4, d_ff=64),
}

_IDS = dict(pad_token_id=PAD_ID, eos_token_id=EOS_ID, bos_token_id=BOS_ID)


def _gpt2(g: Geometry, vocab: int):
    from transformers import GPT2Config

    return GPT2Config(n_layer=g.n_layer, n_embd=g.d_model, n_head=g.n_head, n_inner=g.d_ff, vocab_size=vocab,
                      n_positions=g.max_positions, **_IDS)


def _llama_like(cls_name: str):
    """Llama, Qwen2 and Mistral share their config fields (rotary positions, GQA, untied head)."""

    def make(g: Geometry, vocab: int):
        import transformers

        return getattr(transformers, cls_name)(
            num_hidden_layers=g.n_layer, hidden_size=g.d_model, num_attention_heads=g.n_head,
            num_key_value_heads=g.n_kv_head or g.n_head, intermediate_size=g.d_ff, vocab_size=vocab,
            max_position_embeddings=g.max_positions, tie_word_embeddings=False, **_IDS)

    return make


def _neox(g: Geometry, vocab: int):
    """GPT-NeoX: a quarter of each head's dims rotated (partial rotary), parallel residual, untied head."""
    from transformers import GPTNeoXConfig

    rope = {"rope_theta": 10000.0, "partial_rotary_factor": 0.25, "rope_type": "default"}
    return GPTNeoXConfig(num_hidden_layers=g.n_layer, hidden_size=g.d_model, num_attention_heads=g.n_head,
                         intermediate_size=g.d_ff, vocab_size=vocab, max_position_embeddings=g.max_positions,
                         rope_parameters=rope, **_IDS)


def _phi(g: Geometry, vocab: int):
    """Phi-1/2: half of each head's dims rotated, a biased lm_head, one LayerNorm per block."""
    from transformers import PhiConfig

    return PhiConfig(num_hidden_layers=g.n_layer, hidden_size=g.d_model, num_attention_heads=g.n_head,
                     intermediate_size=g.d_ff, vocab_size=vocab, max_position_embeddings=g.max_positions, **_IDS)


def _opt(g: Geometry, vocab: int):
    """OPT: learned positions stored from an offset of 2, tied head."""
    from transformers import OPTConfig

    return OPTConfig(num_hidden_layers=g.n_layer, hidden_size=g.d_model, num_attention_heads=g.n_head,
                     ffn_dim=g.d_ff, word_embed_proj_dim=g.d_model, vocab_size=vocab,
                     max_position_embeddings=g.max_positions, **_IDS)


def _t5(g: Geometry, vocab: int):
    from transformers import T5Config

    return T5Config(num_layers=g.n_layer, num_decoder_layers=g.n_layer, d_model=g.d_model, num_heads=g.n_head,
                    d_kv=g.d_model // g.n_head, d_ff=g.d_ff, vocab_size=vocab, decoder_start_token_id=PAD_ID,
                    feed_forward_proj="relu", tie_word_embeddings=True, **_IDS)


def _bart_like(cls_name: str, start_id: int, scale_embedding: bool):
    """BART (learned positions from offset 2) and Marian (sinusoidal positions): final_logits_bias, tied head."""

    def make(g: Geometry, vocab: int):
        import transformers

        return getattr(transformers, cls_name)(
            encoder_layers=g.n_layer, decoder_layers=g.n_layer, d_model=g.d_model, encoder_attention_heads=g.n_head,
            decoder_attention_heads=g.n_head, encoder_ffn_dim=g.d_ff, decoder_ffn_dim=g.d_ff, vocab_size=vocab,
            max_position_embeddings=g.max_positions, decoder_start_token_id=start_id, forced_eos_token_id=None,
            scale_embedding=scale_embedding, **_IDS)

    return make


# family -> config builder. BART's decoder starts from eos and Marian's from pad, and Marian
# scales its embeddings by sqrt(d_model), as the released checkpoints of each do.
FAMILIES = {
    "gpt2": _gpt2,
    "llama": _llama_like("LlamaConfig"),
    "qwen2": _llama_like("Qwen2Config"),
    "mistral": _llama_like("MistralConfig"),
    "gpt_neox": _neox,
    "phi": _phi,
    "opt": _opt,
    "t5": _t5,
    "bart": _bart_like("BartConfig", start_id=EOS_ID, scale_embedding=False),
    "marian": _bart_like("MarianConfig", start_id=PAD_ID, scale_embedding=True),
}


def make_config(geom: Geometry, vocab_size: int):
    """An HF config for ``geom``; eos/pad/bos ids follow :data:`SPECIAL_TOKENS`."""
    make = FAMILIES.get(geom.arch)
    if make is None:
        raise ValueError(f"unknown architecture {geom.arch!r}; known: {', '.join(FAMILIES)}")
    cfg = make(geom, vocab_size)
    if geom.sliding_window is not None:
        cfg.sliding_window = geom.sliding_window
    return cfg


def _randomise_buffers(model, seed: int) -> None:
    """Give ``final_logits_bias`` (BART, Marian; zeros at init) values, as a trained checkpoint has.

    A zero bias would let an export or a weight push that drops it pass every parity check.
    """
    import torch

    bias = dict(model.named_buffers()).get("final_logits_bias")
    if bias is not None:
        with torch.no_grad():
            bias.copy_(0.5 * torch.randn(bias.shape, generator=torch.Generator().manual_seed(seed)))


def build_model(name_or_geom: str | Geometry, out_dir: str | Path, seed: int = 0, tokenizer=None) -> Path:
    """Build a random-weight checkpoint of a named geometry and save model + tokenizer to ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    geom = GEOMETRIES[name_or_geom] if isinstance(name_or_geom, str) else name_or_geom
    out_dir = Path(out_dir)
    tok = tokenizer if tokenizer is not None else build_tokenizer()
    cfg = make_config(geom, geom.vocab_size or len(tok))
    torch.manual_seed(seed)
    auto = AutoModelForSeq2SeqLM if cfg.is_encoder_decoder else AutoModelForCausalLM
    model = auto.from_config(cfg).eval()
    _randomise_buffers(model, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    tok.save_pretrained(str(out_dir))
    return out_dir

