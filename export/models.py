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

    arch: str  # "gpt2" | "llama" | "t5"
    n_layer: int
    d_model: int
    n_head: int
    d_ff: int
    vocab_size: int | None = None
    max_positions: int = 256
    n_kv_head: int | None = None  # llama only: grouped-query attention when < n_head


GEOMETRIES: dict[str, Geometry] = {
    "tiny-gpt2": Geometry("gpt2", n_layer=2, d_model=64, n_head=4, d_ff=256),
    "tiny-llama": Geometry("llama", n_layer=2, d_model=64, n_head=4, d_ff=128, n_kv_head=2),
    "tiny-t5": Geometry("t5", n_layer=2, d_model=64, n_head=4, d_ff=128),
    "small-gpt2": Geometry("gpt2", n_layer=4, d_model=128, n_head=4, d_ff=512),
    "small-t5": Geometry("t5", n_layer=3, d_model=128, n_head=4, d_ff=256),
    # GPT-2-small geometry (124M parameters) with random weights, for benchmarks.
    "gpt2-small": Geometry("gpt2", n_layer=12, d_model=768, n_head=12, d_ff=3072, vocab_size=50257, max_positions=1024),
}


def make_config(geom: Geometry, vocab_size: int):
    """An HF config for ``geom``; eos/pad/bos ids follow :data:`SPECIAL_TOKENS`."""
    from transformers import GPT2Config, LlamaConfig, T5Config

    ids = dict(pad_token_id=PAD_ID, eos_token_id=EOS_ID, bos_token_id=BOS_ID)
    if geom.arch == "gpt2":
        return GPT2Config(
            n_layer=geom.n_layer, n_embd=geom.d_model, n_head=geom.n_head, n_inner=geom.d_ff,
            vocab_size=vocab_size, n_positions=geom.max_positions, **ids,
        )
    if geom.arch == "llama":
        return LlamaConfig(
            num_hidden_layers=geom.n_layer, hidden_size=geom.d_model, num_attention_heads=geom.n_head,
            num_key_value_heads=geom.n_kv_head or geom.n_head, intermediate_size=geom.d_ff,
            vocab_size=vocab_size, max_position_embeddings=geom.max_positions, tie_word_embeddings=False, **ids,
        )
    if geom.arch == "t5":
        return T5Config(
            num_layers=geom.n_layer, num_decoder_layers=geom.n_layer, d_model=geom.d_model,
            num_heads=geom.n_head, d_kv=geom.d_model // geom.n_head, d_ff=geom.d_ff, vocab_size=vocab_size,
            decoder_start_token_id=PAD_ID, feed_forward_proj="relu", tie_word_embeddings=True, **ids,
        )
    raise ValueError(f"unknown architecture {geom.arch!r}; known: gpt2, llama, t5")


def build_model(name_or_geom: str | Geometry, out_dir: str | Path, seed: int = 0, tokenizer=None) -> Path:
    """Build a random-weight checkpoint of a named geometry and save model + tokenizer to ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    geom = GEOMETRIES[name_or_geom] if isinstance(name_or_geom, str) else name_or_geom
    out_dir = Path(out_dir)
    tok = tokenizer if tokenizer is not None else build_tokenizer()
    cfg = make_config(geom, geom.vocab_size or len(tok))
    torch.manual_seed(seed)
    auto = AutoModelForSeq2SeqLM if geom.arch == "t5" else AutoModelForCausalLM
    model = auto.from_config(cfg).eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    tok.save_pretrained(str(out_dir))
    return out_dir


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="refit build-model", description=build_model.__doc__)
    p.add_argument("geometry", choices=sorted(GEOMETRIES), help="named model geometry")
    p.add_argument("-o", "--out", required=True, help="output checkpoint folder")
    p.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    p.add_argument("--chat", action="store_true", help="tokenizer with a ChatML-style chat template (<|im_start|>, "
                                                       "<|im_end|> added as special tokens)")
    a = p.parse_args(argv)
    print(build_model(a.geometry, a.out, seed=a.seed, tokenizer=build_chat_tokenizer() if a.chat else None))
    return 0
