"""Published model configurations, for tests and the family table at real geometry.

Each entry holds the values of a released model's own ``config.json`` (written here from the public
files, nothing downloaded): widths, head dims, grouped KV heads, vocabulary, rope settings, norms,
soft-capping, windows. :func:`published_config` turns one into an HF config with the depth cut (2
layers by default; ``n_layers=None`` keeps the published depth) and the special token ids of the
local tokenizer (:mod:`refit.learner.builtin.models`); :func:`build_published` saves a random-weight checkpoint with
that tokenizer. The tokenizer has a few hundred ids, the model its published vocabulary: a model may
have a larger embedding than its tokenizer (``refit.core.hf_folder`` refuses only the reverse).

Values checked against the transformers 5 config classes' fields and defaults; where a value is from
memory of the released file and not otherwise checked, the entry's ``unsure`` says which.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from refit.core.errors import RefitError
from refit.learner.builtin.models import BOS_ID, EOS_ID, PAD_ID, _randomise_buffers, build_tokenizer


@dataclass(frozen=True)
class Published:
    """One released model's configuration."""

    source: str  # the hub repository whose config.json these values are (for the record; never fetched)
    config: dict  # config.json fields: model_type + the values that shape the model, published depth included
    depth: tuple[str, ...]  # the fields holding layer counts (cut by published_config)
    decoder_start: int | None = None  # encoder-decoder: the local tokenizer's id the decoder starts from
    features: str = ""  # what this geometry exercises, in a few words
    unsure: str = ""  # values not confirmed beyond memory of the released config.json


_DEC = ("num_hidden_layers",)

def _llama32(size: str, hidden: int, heads: int, head_dim: int, layers: int, features: str) -> Published:
    """A Llama 3.2 base model: GQA to 8 KV heads, llama3 rope scaling (factor 32 from 8192), tied, vocab 128256."""
    return Published(
        f"meta-llama/Llama-3.2-{size}",
        dict(model_type="llama", hidden_size=hidden, intermediate_size=8192, num_attention_heads=heads,
             num_key_value_heads=8, head_dim=head_dim, num_hidden_layers=layers, vocab_size=128256,
             max_position_embeddings=131072, rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=True,
             attention_bias=False, mlp_bias=False, rope_theta=500000.0,
             rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=8192)),
        _DEC, features=features)


def _qwen25(size: str, hidden: int, intermediate: int, heads: int, layers: int, max_positions: int) -> Published:
    """A Qwen2.5 base model: qkv bias, GQA to 2 KV heads, rope theta 1e6, no sliding window, tied, vocab 151936."""
    return Published(
        f"Qwen/Qwen2.5-{size}",
        dict(model_type="qwen2", hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
             num_key_value_heads=2, num_hidden_layers=layers, vocab_size=151936,
             max_position_embeddings=max_positions, rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=True,
             rope_theta=1000000.0, use_sliding_window=False, sliding_window=max_positions,
             max_window_layers=layers),
        _DEC, features=f"qkv bias, GQA {heads}/2, head_dim {hidden // heads}, tied, vocab 151936")


PUBLISHED: dict[str, Published] = {
    "Llama 3.2 1B": _llama32("1B", 2048, 32, 64, 16, "rope llama3 scaling (factor 32), GQA 32/8, tied, vocab 128256"),
    "Qwen2.5 0.5B": _qwen25("0.5B", 896, 4864, 14, 24, 32768),
    "Qwen2.5 1.5B": _qwen25("1.5B", 1536, 8960, 12, 28, 131072),
    "Qwen2.5 3B": _qwen25("3B", 2048, 11008, 16, 36, 32768),
    "Llama 3.2 3B": _llama32("3B", 3072, 24, 128, 28,
                             "rope llama3 scaling (factor 32), GQA 24/8, head_dim 128, tied, vocab 128256"),
    "Qwen3 0.6B": Published(
        "Qwen/Qwen3-0.6B",
        dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128, num_hidden_layers=28, vocab_size=151936,
             max_position_embeddings=40960, rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=True,
             rope_theta=1000000.0, attention_bias=False, use_sliding_window=False, sliding_window=None,
             max_window_layers=28),
        _DEC, features="q/k RMSNorm, head_dim 128 > hidden/heads, GQA 16/8, tied, vocab 151936"),
    "SmolLM2 135M": Published(
        "HuggingFaceTB/SmolLM2-135M",
        dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_attention_heads=9,
             num_key_value_heads=3, num_hidden_layers=30, vocab_size=49152, max_position_embeddings=8192,
             rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=True, rope_theta=100000.0),
        _DEC, features="9 heads of 64, GQA 9/3, tied, vocab 49152"),
    "Mistral 7B v0.1": Published(
        "mistralai/Mistral-7B-v0.1",
        dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
             num_key_value_heads=8, head_dim=128, num_hidden_layers=32, vocab_size=32000,
             max_position_embeddings=32768, rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False,
             rope_theta=10000.0, sliding_window=4096),
        _DEC, features="sliding window 4096, head_dim 128, GQA 32/8, untied"),
    "Phi-3 mini": Published(
        "microsoft/Phi-3-mini-4k-instruct",
        dict(model_type="phi3", hidden_size=3072, intermediate_size=8192, num_attention_heads=32,
             num_key_value_heads=32, num_hidden_layers=32, vocab_size=32064, max_position_embeddings=4096,
             original_max_position_embeddings=4096, rms_norm_eps=1e-5, hidden_act="silu",
             tie_word_embeddings=False, rope_theta=10000.0, sliding_window=2047),
        _DEC, features="fused qkv_proj and gate_up_proj, head_dim 96, MHA, untied, window 2047",
        unsure="sliding_window 2047 (the 4k-instruct file's value as remembered)"),
    "Gemma 2 2B": Published(
        "google/gemma-2-2b",
        dict(model_type="gemma2", hidden_size=2304, intermediate_size=9216, num_attention_heads=8,
             num_key_value_heads=4, head_dim=256, num_hidden_layers=26, vocab_size=256000,
             max_position_embeddings=8192, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
             tie_word_embeddings=True, rope_theta=10000.0, query_pre_attn_scalar=256, sliding_window=4096,
             final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
        _DEC, features="head_dim 256, attn/final soft-capping 50/30, query_pre_attn_scalar 256, alternating "
                       "window 4096 (layer 0 sliding, 1 full), 1 + w RMSNorm, embed x sqrt(2304), tied, vocab 256000"),
    "GPT-2 small": Published(
        "openai-community/gpt2",
        dict(model_type="gpt2", n_embd=768, n_head=12, n_layer=12, n_positions=1024, vocab_size=50257,
             n_inner=None, activation_function="gelu_new", layer_norm_epsilon=1e-5, tie_word_embeddings=True),
        ("n_layer",), features="learned positions (1024), 12 heads of 64, tied, vocab 50257"),
    "T5-small": Published(
        "google-t5/t5-small",
        dict(model_type="t5", d_model=512, d_kv=64, d_ff=2048, num_heads=8, num_layers=6, num_decoder_layers=6,
             vocab_size=32128, relative_attention_num_buckets=32, relative_attention_max_distance=128,
             feed_forward_proj="relu", layer_norm_epsilon=1e-6, tie_word_embeddings=True),
        ("num_layers", "num_decoder_layers"), decoder_start=PAD_ID,
        features="relative position bias, tied (scaled) head, vocab 32128"),
    "BART-base": Published(
        "facebook/bart-base",
        dict(model_type="bart", d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12,
             decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072, vocab_size=50265,
             max_position_embeddings=1024, activation_function="gelu", scale_embedding=False,
             forced_eos_token_id=None),
        ("encoder_layers", "decoder_layers"), decoder_start=EOS_ID,
        features="learned positions from offset 2, final_logits_bias, tied, vocab 50265"),
    "opus-mt-en-de": Published(
        "Helsinki-NLP/opus-mt-en-de",
        dict(model_type="marian", d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
             decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048, vocab_size=58101,
             max_position_embeddings=512, activation_function="swish", scale_embedding=True,
             share_encoder_decoder_embeddings=True, forced_eos_token_id=None),
        ("encoder_layers", "decoder_layers"), decoder_start=PAD_ID,
        features="sinusoidal positions, embed x sqrt(512), final_logits_bias, tied, vocab 58101"),
}


def published_config(name: str, n_layers: int | None = 2):
    """The HF config of ``PUBLISHED[name]`` with every depth field set to ``n_layers`` (None: as published) and
    the local tokenizer's pad/eos/bos ids (and decoder start id for encoder-decoders)."""
    from transformers import AutoConfig

    if name not in PUBLISHED:
        raise RefitError(f"unknown published geometry {name!r}; known: {', '.join(PUBLISHED)}")
    p = PUBLISHED[name]
    fields = dict(p.config)
    model_type = fields.pop("model_type")
    if n_layers is not None:
        fields.update({k: n_layers for k in p.depth})
    fields.update(pad_token_id=PAD_ID, eos_token_id=EOS_ID, bos_token_id=BOS_ID)
    if p.decoder_start is not None:
        fields["decoder_start_token_id"] = p.decoder_start
    return AutoConfig.for_model(model_type, **fields)


def n_params(name: str, n_layers: int | None = 2) -> int:
    """Parameters of the geometry (tied weights counted once), from a model on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    cfg = published_config(name, n_layers)
    auto = AutoModelForSeq2SeqLM if cfg.is_encoder_decoder else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


def build_published(name: str, out_dir: str | Path, n_layers: int | None = 2, seed: int = 0,
                    tokenizer=None, vocab_size: int | None = None) -> Path:
    """Save a random-weight checkpoint of ``PUBLISHED[name]`` (depth ``n_layers``) and the local tokenizer
    (:func:`refit.learner.builtin.models.build_tokenizer`) to ``out_dir``; fp32, as :func:`refit.learner.builtin.models.build_model`.
    ``vocab_size``: the vocabulary cut to that many rows (None: the published one)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    cfg = published_config(name, n_layers)
    if vocab_size is not None:
        cfg.vocab_size = vocab_size
    tok = tokenizer if tokenizer is not None else build_tokenizer()
    torch.manual_seed(seed)
    auto = AutoModelForSeq2SeqLM if cfg.is_encoder_decoder else AutoModelForCausalLM
    model = auto.from_config(cfg, dtype=torch.float32).eval()
    _randomise_buffers(model, seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    tok.save_pretrained(str(out_dir))
    return out_dir
