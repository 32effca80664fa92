"""One spelling difference across transformers 5 releases: the forward's KV-cache argument and output field.

Earlier 5.x releases (e.g. 5.17) call it ``past_key_values``; later ones (5.25) ``cache``. Refit supports
every transformers 5 release its ``pyproject.toml`` admits, so the name is read once from the installed
library (the output dataclass's own fields), not assumed.
"""

from __future__ import annotations

import functools


@functools.cache
def cache_name() -> str:
    """``"cache"`` or ``"past_key_values"``: the installed transformers' name for the KV cache."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def cache_kw(cache) -> dict:
    """The forward keyword that hands ``cache`` in: ``model(..., **cache_kw(cache))``."""
    return {cache_name(): cache}


def cache_of(out):
    """The KV cache a forward returned (``out.cache`` or ``out.past_key_values``)."""
    return getattr(out, cache_name())
