"""Mixture-of-experts checkpoints built locally (random weights, the local tokenizer), as :mod:`refit.learner.builtin.models`.

Two families, each a tiny CI geometry and a published one:

- Mixtral-8x7B (``MixtralConfig``): hidden 4096, 32 heads, 8 KV heads (head_dim 128), intermediate 14336,
  8 experts, top-2, vocab 32000, rope theta 1e6, untied head, 32 layers.
- Qwen3-30B-A3B (``Qwen3MoeConfig``): hidden 2048, 32 heads, 4 KV heads, head_dim 128 (> hidden/heads),
  q/k RMSNorm, moe_intermediate_size 768, 128 experts, top-8 (renormalised), vocab 151936, rope theta 1e6,
  untied head, 48 layers.

Values from the models' own ``config.json``. :func:`moe_config` cuts depth, expert count,
expert width and vocabulary on request: at full width neither fits the shared 24 GB machine
(one Mixtral expert is 176M parameters; the exporter peaks at about 6x the model's fp32 size).
"""

from __future__ import annotations

from pathlib import Path

from refit.learner.builtin.models import BOS_ID, EOS_ID, PAD_ID

_IDS = dict(pad_token_id=PAD_ID, eos_token_id=EOS_ID, bos_token_id=BOS_ID, tie_word_embeddings=False)

PUBLISHED = {
    "mixtral-8x7b": dict(arch="mixtral", hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, intermediate_size=14336, num_experts=8, top_k=2, vocab_size=32000,
                         num_hidden_layers=32, rope_theta=1e6),
    "qwen3-30b-a3b": dict(arch="qwen3_moe", hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, intermediate_size=768, num_experts=128, top_k=8, vocab_size=151936,
                          num_hidden_layers=48, rope_theta=1e6),
    # CI sizes: every expert tensor > 8192 values (refit.export.moe: smaller ones would be folded per expert)
    "tiny-mixtral": dict(arch="mixtral", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         intermediate_size=96, num_experts=4, top_k=2, vocab_size=None, num_hidden_layers=2,
                         rope_theta=1e6),
    "tiny-qwen3-moe": dict(arch="qwen3_moe", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=32, intermediate_size=48, num_experts=8, top_k=2, vocab_size=None,
                           num_hidden_layers=2, rope_theta=1e6),
}


def moe_config(name: str, tokenizer_vocab: int, **cut):
    """The HF config of ``name`` (:data:`PUBLISHED`); ``cut`` overrides fields (layers, experts, widths).
    A vocabulary of None is the tokenizer's (``tokenizer_vocab``)."""
    g = {**PUBLISHED[name], **cut}
    vocab = g["vocab_size"] or tokenizer_vocab
    common = dict(num_hidden_layers=g["num_hidden_layers"], hidden_size=g["hidden_size"],
                  num_attention_heads=g["num_attention_heads"], num_key_value_heads=g["num_key_value_heads"],
                  head_dim=g["head_dim"], num_experts_per_tok=g["top_k"], vocab_size=vocab,
                  rope_parameters={"rope_type": "default", "rope_theta": g["rope_theta"]},
                  max_position_embeddings=4096, **_IDS)
    if g["arch"] == "mixtral":
        from transformers import MixtralConfig

        return MixtralConfig(intermediate_size=g["intermediate_size"], num_local_experts=g["num_experts"], **common)
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(moe_intermediate_size=g["intermediate_size"], num_experts=g["num_experts"],
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], **common)


def build_moe_model(name: str, out_dir: str | Path, tokenizer, seed: int = 0, **cut) -> Path:
    """Random-weight checkpoint of ``name`` (with ``cut``) and the tokenizer, saved to ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = moe_config(name, len(tokenizer), **cut)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return out_dir
