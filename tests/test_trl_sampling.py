"""TRL's sampling settings on Refit's facade: min_p, repetition_penalty, generation_kwargs (over the sampling fields,
as TRL updates its GenerationConfig) and chat_template_kwargs (apply_chat_template's keywords), for GRPOConfig,
RLOOConfig and DistillationConfig; the keys Refit's sampler cannot take refused in one line."""

from __future__ import annotations

import pytest

from refit.core.errors import RefitError
from refit.learner.builtin.models import build_chat_tokenizer
from refit.learner.run.chat import as_pairs, encode_prompts, template_kwargs
from refit.learner.trl import DistillationConfig, to_distill_config
from refit.learner.trl import GRPOConfig, RLOOConfig, to_ppo_config

THINKING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
            "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")  # Qwen3's switch


@pytest.mark.parametrize("cls", [GRPOConfig, RLOOConfig])
def test_grpo_and_rloo_map_min_p_repetition_penalty_and_chat_kwargs(cls):
    args = cls(output_dir="o", max_steps=1, per_device_train_batch_size=8, num_generations=4, temperature=0.7,
               top_p=0.9, min_p=0.05, repetition_penalty=1.2, max_completion_length=12,
               chat_template_kwargs={"enable_thinking": False, "reasoning_effort": "low"})
    c = to_ppo_config(args, "m")
    s = c.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty, c.response_length) == (
        0.7, 0.9, 0, 0.05, 1.2, 12)
    assert c.data.chat_template_kwargs == ("enable_thinking=false", 'reasoning_effort="low"')
    assert template_kwargs(c.data.chat_template_kwargs) == {"enable_thinking": False, "reasoning_effort": "low"}
    plain = to_ppo_config(cls(output_dir="o", max_steps=1, per_device_train_batch_size=8, num_generations=4), "m")
    assert (plain.sampling.min_p, plain.sampling.repetition_penalty, plain.data.chat_template_kwargs) == (0.0, 1.0, ())


def test_generation_kwargs_override_the_fields_as_trls_generation_config_update():
    """TRL: ``generation_kwargs.update(args.generation_kwargs)`` over temperature, top_p, top_k, min_p,
    repetition_penalty and max_new_tokens (= max_completion_length); do_sample=True is TRL's own."""
    c = to_ppo_config(GRPOConfig(output_dir="o", max_steps=1, per_device_train_batch_size=8, num_generations=4,
                                 top_k=5, max_completion_length=12, min_p=0.1,
                                 generation_kwargs={"top_k": 20, "top_p": 0.95, "min_p": None, "max_new_tokens": 9,
                                                    "repetition_penalty": 1.1, "temperature": 0.8,
                                                    "do_sample": True}), "m")
    s = c.sampling
    assert (s.top_k, s.top_p, s.min_p, s.repetition_penalty, s.temperature, c.response_length) == (
        20, 0.95, 0.0, 1.1, 0.8, 9)


def test_distillation_maps_them_and_keeps_the_loss_temperature():
    d = to_distill_config(DistillationConfig(output_dir="o", max_steps=2, temperature=0.9, min_p=0.02,
                                             repetition_penalty=1.3, max_completion_length=16,
                                             generation_kwargs={"temperature": 0.6, "max_new_tokens": 8},
                                             chat_template_kwargs={"enable_thinking": False}), "s", "t")
    s = d.sampling
    assert (s.temperature, d.loss_temperature, s.min_p, s.repetition_penalty, d.max_new_tokens) == (
        0.6, 0.9, 0.02, 1.3, 8)  # TRL: generation at 0.6, the loss at args.temperature
    assert d.data.chat_template_kwargs == ("enable_thinking=false",)


@pytest.mark.parametrize("make, msg", [
    (lambda: to_ppo_config(GRPOConfig(output_dir="o", max_steps=1, generation_kwargs={"num_beams": 2}), "m"),
     "GRPOConfig: generation_kwargs 'num_beams' is not supported; Refit's engine sampler takes temperature, top_k, "
     "top_p, min_p, repetition_penalty, max_new_tokens (and do_sample=True)"),
    (lambda: to_ppo_config(RLOOConfig(output_dir="o", max_steps=1, generation_kwargs={"do_sample": False}), "m"),
     "RLOOConfig: generation_kwargs do_sample=False: the engine samples"),
    (lambda: to_distill_config(DistillationConfig(output_dir="o", max_steps=1,
                                                  generation_kwargs={"eos_token_id": 3}), "s", "t"),
     "DistillationConfig: generation_kwargs 'eos_token_id' is not supported"),
    (lambda: to_ppo_config(GRPOConfig(output_dir="o", max_steps=1, min_p=1.5), "m"),
     "config: min_p = 1.5 is out of range; allowed: in [0, 1]"),
    (lambda: to_ppo_config(GRPOConfig(output_dir="o", max_steps=1, repetition_penalty=0.0), "m"),
     "config: repetition_penalty = 0.0 is out of range; allowed: > 0"),
    (lambda: to_ppo_config(GRPOConfig(output_dir="o", max_steps=1, chat_template_kwargs={"tools": object()}), "m"),
     "GRPOConfig: chat_template_kwargs: tools=<object"),
    (lambda: template_kwargs(("enable_thinking",)), "data.chat_template_kwargs: 'enable_thinking' is not KEY=VALUE"),
])
def test_what_the_sampler_cannot_take_is_one_line(make, msg):
    with pytest.raises(RefitError) as e:
        make()
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_chat_template_kwargs_reach_apply_chat_template():
    """The ids Refit's engine and learner get are those of TRL's rendering, apply_chat_template(prompt,
    add_generation_prompt=True, **chat_template_kwargs), tokenized without extra special tokens."""
    tok = build_chat_tokenizer()
    tok.chat_template = THINKING
    prompt = [{"role": "user", "content": "12+34="}]
    pairs = as_pairs({"enable_thinking": False})
    got = encode_prompts(tok, [prompt, "plain text"], None, 8, chat_kwargs=pairs)
    want = tok(tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, enable_thinking=False),
               add_special_tokens=False).input_ids
    assert got[0] == want and got[1] == tok("plain text", add_special_tokens=False).input_ids
    assert got[0] != encode_prompts(tok, [prompt], None, 8)[0]  # without it the template renders no <think>
    assert "<think>" in tok.decode(got[0])
