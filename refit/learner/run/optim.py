"""The optimizer and its schedule, as transformers' ``Trainer`` builds them for TRL (``create_optimizer`` /
``create_scheduler``): torch's AdamW with ``betas=(adam_beta1, adam_beta2)``, ``eps=adam_epsilon``, and
``transformers.get_scheduler(lr_scheduler_type, ..., scheduler_specific_kwargs=lr_scheduler_kwargs)``; and NEFTune
(``neftune_noise_alpha``), the noise transformers' ``activate_neftune`` adds to the input embeddings.

Both jobs (PPO, distillation) and the TRL facade's logged learning rate build from here, so one
:class:`~refit.learner.run.config.OptimSection` means one schedule everywhere.
"""

from __future__ import annotations

import contextlib
import math

import torch
import yaml

from refit.core.errors import RefitError


def _value(text: str):
    """A NAME=VALUE's VALUE: an int, a float (``1e-5`` too, which YAML 1.1 leaves a string), else YAML's reading
    (true, a word, a JSON list)."""
    text = text.strip()
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return yaml.safe_load(text) if text else None


def scheduler_kwargs(optim) -> dict:
    """``optim.lr_scheduler_kwargs`` (NAME=VALUE strings) as get_scheduler's keywords."""
    return {kv.partition("=")[0].strip(): _value(kv.partition("=")[2]) for kv in optim.lr_scheduler_kwargs}


def adamw(groups, optim) -> torch.optim.AdamW:
    """torch's AdamW over ``groups`` (parameters or param groups) with ``optim``'s rate, decay, betas and eps."""
    return torch.optim.AdamW(groups, lr=optim.learning_rate, weight_decay=optim.weight_decay,
                             betas=(optim.adam_beta1, optim.adam_beta2), eps=optim.adam_epsilon)


def schedule(optimizer: torch.optim.Optimizer, optim, total: int):
    """transformers' ``get_scheduler`` of ``optim.lr_scheduler_type`` over ``total`` optimizer steps, with
    ``optim.warmup_steps`` and the schedule's own ``lr_scheduler_kwargs``; a keyword the schedule does not take, or
    one it needs and lacks (cosine_with_min_lr without min_lr / min_lr_rate), is one line."""
    from transformers import get_scheduler

    kw = scheduler_kwargs(optim)
    try:
        return get_scheduler(optim.lr_scheduler_type, optimizer, num_warmup_steps=optim.warmup_steps,
                             num_training_steps=total, scheduler_specific_kwargs=kw)
    except (TypeError, ValueError) as e:
        raise RefitError(f"optim.lr_scheduler_kwargs {kw} for lr_scheduler_type {optim.lr_scheduler_type!r}: "
                         f"{(str(e).splitlines() or [''])[0]}") from None


def rates(optim, total: int):
    """optimizer steps taken -> the learning rate of the next one, from :func:`schedule` over ``total`` steps (a
    throwaway optimizer, so no model is touched)."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=optim.learning_rate)
    sched = schedule(opt, optim, total)
    return lambda n: optim.learning_rate * sched.lr_lambdas[0](n)


def neftune_noise(embeds: torch.Tensor, alpha: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """NEFTune's noise for input embeddings ``embeds`` (B, L, d): uniform in [-m, m] with m = alpha / sqrt(L * d)
    (Jain et al. 2023, eq. in Algorithm 1; transformers' ``neftune_post_forward_hook``). Returns (B, L, d)."""
    mag = alpha / math.sqrt(embeds.shape[1] * embeds.shape[2])
    noise = torch.empty_like(embeds)
    return noise.uniform_(-mag, mag, generator=generator) if generator is not None else noise.uniform_(-mag, mag)


def input_embeddings(model) -> torch.nn.Module:
    """The input embedding module of an HF model, a PEFT model (its base's, as transformers hooks it) or a DDP
    wrapper of either."""
    model = getattr(model, "module", model)
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    return model.get_input_embeddings()


@contextlib.contextmanager
def neftune(model, alpha: float):
    """Inside: every forward of ``model``'s input embeddings gets :func:`neftune_noise` added (transformers adds it
    while the module is in training mode; Refit's learner runs without dropout, so the context marks the training
    forward passes instead). ``alpha`` 0: nothing is hooked."""
    if not alpha:
        yield
        return
    handle = input_embeddings(model).register_forward_hook(lambda m, i, out: out + neftune_noise(out, alpha))
    try:
        yield
    finally:
        handle.remove()
