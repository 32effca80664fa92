"""The reference sync of TR-DPO (Gorbatovski et al. 2024, "Learn Your Reference Model for Real Good Alignment"), as
TRL's ``SyncRefModelCallback`` does it for GRPO and RLOO (``sync_ref_model``): after every optimizer step whose
number is a multiple of ``ref_model_sync_steps``, each reference weight becomes
``alpha * policy + (1 - alpha) * reference`` (``ref_model_mixup_alpha``); the reference's log-probs of the next
rollout come from the mixed weights.

Refit's reference is a PyTorch model or an ONNX Runtime engine over the policy's exported folder (``ref_backend``).
The mixing is done on a PyTorch copy in either case (the engine's sessions hold no readable weights), and an engine
reference then takes the mixed weights as one complete push, as the policy engine takes the policy's. Before the
first sync the reference is the step-0 policy, so KL(0) = 0 still holds. The mixed weights are part of every
checkpoint (``reference.pt``), so ``--resume`` continues with them.

A LoRA run has no reference of its own to mix: its reference is the base with the adapter off (one copy of the
base, shared with the policy). TRL 1.16 refuses ``sync_ref_model`` with a PEFT model for the same reason
(NotImplementedError), and so does Refit (refit.learner.ppo.config).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from refit.core.contract import canonical_params
from refit.core.hf_folder import load_model
from refit.rollout.engine import Engine

REFERENCE_FILE = "reference.pt"  # a checkpoint's mixed reference weights (with its sync count)


@torch.no_grad()
def mix_into(ref: torch.nn.Module, policy: torch.nn.Module, alpha: float) -> None:
    """``ref <- alpha * policy + (1 - alpha) * ref``, parameter by parameter in place (TRL's ``_sync_target_model``:
    ``ref.mul_(1 - alpha).add_(policy, alpha=alpha)``); the two models share one architecture."""
    for r, p in zip(ref.parameters(), policy.parameters(), strict=True):
        r.mul_(1.0 - alpha).add_(p.detach().to(r.device, r.dtype), alpha=alpha)


@dataclass
class RefSync:
    """The reference to mix (``module``), its engine when it scores on one, and when to mix."""

    module: torch.nn.Module  # the reference's weights in PyTorch (the scoring reference itself when it scores here)
    alpha: float  # ref_model_mixup_alpha
    every: int  # ref_model_sync_steps, in optimizer steps
    per: int  # optimizer steps per Refit step (num_ppo_epochs x num_mini_batches; every is a multiple of it)
    engine: Engine | None = None  # the reference engine that takes each mix as a push (None: PyTorch scores)
    syncs: int = 0

    def due(self, step: int) -> bool:
        """TRL's ``global_step % ref_model_sync_steps == 0`` at the last optimizer step of Refit step ``step``."""
        return (step * self.per) % self.every == 0

    def after_step(self, policy: torch.nn.Module, step: int) -> dict[str, float]:
        """After step ``step``'s optimizer steps: mix when due (and push into the engine); the sync count."""
        if self.due(step):
            mix_into(self.module, policy, self.alpha)
            self.syncs += 1
            self.push()
        return {"ref/syncs": float(self.syncs)}

    def push(self) -> None:
        if self.engine is not None:
            self.engine.update_weights(canonical_params(self.module)[0])

    def attach(self, engine: Engine | None) -> None:
        """The reference engine, given the mixed weights at once when a resumed run has synced already."""
        self.engine = engine
        if self.syncs:
            self.push()

    def state(self) -> dict:
        return {"syncs": self.syncs, "weights": self.module.state_dict()}

    def restore(self, state: dict) -> None:
        self.module.load_state_dict(state["weights"])
        self.syncs = int(state["syncs"])


def reference_sync(cfg, ref: torch.nn.Module | None, info, device) -> RefSync | None:
    """``cfg.sync_ref_model``'s :class:`RefSync` over the PyTorch reference ``ref`` (its own copy of the step-0
    policy is loaded when an engine scores the reference instead); None when the reference is not synced."""
    if not cfg.sync_ref_model:
        return None
    module = ref if ref is not None else load_model(cfg.model.model_dir, info).to(device).requires_grad_(False)
    return RefSync(module, cfg.ref_model_mixup_alpha, cfg.ref_model_sync_steps,
                   cfg.num_ppo_epochs * cfg.num_mini_batches)


def restore_reference(sync: RefSync | None, checkpoint: Path) -> None:
    """``--resume``: the mixed reference saved in ``checkpoint`` (none there or no sync: nothing to do)."""
    if sync is not None and (Path(checkpoint) / REFERENCE_FILE).is_file():
        sync.restore(torch.load(Path(checkpoint) / REFERENCE_FILE, weights_only=False))
