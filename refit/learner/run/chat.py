"""Prompts as token ids, through the tokenizer's chat template when they are chat messages (TRL's conventions).

A prompt is either text (used as is) or a list of chat messages ``[{"role": ..., "content": ...}, ...]``
(TRL's "conversational" format), rendered with ``tokenizer.apply_chat_template(messages,
add_generation_prompt=True, **chat_template_kwargs)`` (``data.chat_template_kwargs``: TRL's, e.g.
``enable_thinking=False``; :func:`template_kwargs`). Either way the text is tokenized with
``add_special_tokens=False``: the
template already wrote any BOS / turn markers, and adding them again would change the prompt the
engine and the learner both see. The ids are the same on both sides, so the template's special tokens
cannot move the log-prob contract (KL at step 0 stays exactly 0).

The end of an assistant turn is found by rendering a two-turn conversation and reading the token the
template writes right after the assistant's text (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``, ...);
generation stops there as well as at EOS (:func:`end_of_turn_ids`), and at the model's generation_config EOS ids
(:func:`stop_ids_of`).
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from refit.core.errors import RefitError
from refit.core.hf_folder import generation_eos_ids

Prompt = Any  # str | list[dict[str, str]]
_MARK = "\u2063refit-end-of-turn-probe\u2063"


def is_conversational(prompt: Prompt) -> bool:
    """True for a list of ``{"role", "content"}`` messages (TRL ``is_conversational``)."""
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)


def check_prompt(prompt: Prompt, where: str) -> None:
    """One line unless ``prompt`` is non-empty text or a non-empty list of chat messages."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise RefitError(f"{where}: empty prompt")
        return
    if not (isinstance(prompt, list) and prompt and is_conversational(prompt)):
        raise RefitError(f"{where}: the prompt must be text or a list of {{'role', 'content'}} messages, got "
                         f"{type(prompt).__name__} {str(prompt)[:60]!r}")


def template_kwargs(pairs: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """``data.chat_template_kwargs`` (``KEY=VALUE`` strings, each value a YAML scalar) as apply_chat_template's
    keywords; one line for a pair without ``=``."""
    out = {}
    for pair in pairs:
        key, eq, value = str(pair).partition("=")
        if not eq or not key.strip():
            raise RefitError(f"data.chat_template_kwargs: {pair!r} is not KEY=VALUE (e.g. enable_thinking=false)")
        out[key.strip()] = yaml.safe_load(value) if value.strip() else ""
    return out


def as_pairs(kwargs: dict[str, Any] | None, owner: str = "chat_template_kwargs") -> tuple[str, ...]:
    """A TRL ``chat_template_kwargs`` dict as ``data.chat_template_kwargs`` pairs (:func:`template_kwargs` reads
    them back): each value written as JSON, which YAML reads as the same scalar; one line for a value that is not
    a JSON scalar or list."""
    pairs = []
    for key, value in (kwargs or {}).items():
        try:
            text = json.dumps(value)
        except TypeError:
            raise RefitError(f"{owner}: {key}={value!r}: Refit takes text, numbers, booleans, None and lists "
                             "of them") from None
        if yaml.safe_load(text) != value:
            raise RefitError(f"{owner}: {key}={value!r} does not survive the saved config")
        pairs.append(f"{key}={text}")
    return tuple(pairs)


def render(tok, prompt: Prompt, where: str = "prompt", kwargs: dict[str, Any] | None = None) -> str:
    """Text of ``prompt``: as is, or the chat template with the generation prompt appended (``kwargs``: more
    keywords for apply_chat_template, TRL's ``chat_template_kwargs``)."""
    if isinstance(prompt, str):
        return prompt
    if not getattr(tok, "chat_template", None):
        raise RefitError(f"{where} is a list of chat messages but the tokenizer has no chat_template; give text "
                         "prompts or a tokenizer with a template")
    try:
        return tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, **(kwargs or {}))
    except Exception as e:  # noqa: BLE001 - a template error (role order, ...) is the user's, one line
        raise RefitError(f"{where}: the chat template failed: {type(e).__name__}: {str(e).splitlines()[0]}") from None


def encode_prompts(tok, prompts: list[Prompt], max_positions: int | None, response_length: int,
                   what: str = "dataset", chat_kwargs: tuple[str, ...] = ()) -> list[list[int]]:
    """Token ids of every prompt (rendered, ``add_special_tokens=False``; ``chat_kwargs``: the
    ``data.chat_template_kwargs`` pairs); one line naming the row when a prompt is empty, not a prompt, or too
    long for the model with ``response_length`` new tokens."""
    out = []
    kwargs = template_kwargs(chat_kwargs)
    for i, p in enumerate(prompts):
        where = f"{what} row {i}"
        check_prompt(p, where)
        ids = tok(render(tok, p, where, kwargs), add_special_tokens=False).input_ids
        if not ids:
            raise RefitError(f"{where}: the prompt tokenizes to nothing")
        if max_positions is not None and len(ids) + response_length > max_positions:
            templ = " after the chat template" if not isinstance(p, str) else ""
            raise RefitError(f"{where}: the prompt is {len(ids)} tokens{templ}; with response_length "
                             f"{response_length} that exceeds the model's {max_positions} positions")
        out.append(ids)
    return out


def end_of_turn_ids(tok) -> tuple[int, ...]:
    """Token ids the chat template ends an assistant turn with (besides EOS); () without a template.

    Rendered, not guessed from names: the first token after the assistant's text in a two-turn
    conversation, if it is a special token.
    """
    if not getattr(tok, "chat_template", None):
        return ()
    try:
        text = tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": _MARK}],
                                       tokenize=False)
    except Exception:  # noqa: BLE001 - a template that cannot render this: EOS alone stops generation
        return ()
    after = text.split(_MARK, 1)[1] if _MARK in text else ""
    ids = tok(after, add_special_tokens=False).input_ids if after else []
    special = set(tok.all_special_ids)
    if ids and ids[0] in special and ids[0] != tok.eos_token_id:
        return (int(ids[0]),)
    return ()


def stop_ids_of(tok, model_dir, eos_id: int | None) -> tuple[int, ...]:
    """The ids generation stops at besides the model's EOS ``eos_id`` (its config's, where the engine stops):
    :func:`end_of_turn_ids` first, then the other ids of ``model_dir``'s generation_config.json ``eos_token_id``
    (transformers' ``generate``, and TRL's GKDTrainer, which generates with the model's ``generation_config``, stop
    at each)."""
    turn = end_of_turn_ids(tok)
    return turn + tuple(i for i in generation_eos_ids(model_dir) if i not in turn and i != eos_id)


def completion_for(prompt: Prompt, text: str) -> Any:
    """What a reward function receives as the completion: text for a text prompt, and for a chat prompt
    ``[{"role": "assistant", "content": text}]`` (TRL GRPOTrainer's conversational convention)."""
    return [{"role": "assistant", "content": text}] if not isinstance(prompt, str) else text
