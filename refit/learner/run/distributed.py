"""The learner on K processes: ``torchrun --nproc-per-node K -m refit ppo|distill ...`` (DDP).

PPO is described below; distillation (:mod:`refit.learner.distill`) follows the same rules: rank 0 makes
the batch (engines, teacher targets) and shares it, rank r runs its contiguous slice of rows, the
loss is normalised by the global token count and multiplied by K before ``backward``.

    rank 0 : rollouts on the engine (or a RayEnginePool), rewards, learner/reference log-probs,
             advantages -> broadcast the Experience -> its slice of the update -> weight push,
             parity probe, metrics, checkpoints (atomic, written once)
    rank r : receive the Experience -> its slice of the update

The update is the same as one process's :func:`refit.learner.ppo.update.ppo_update` on the global batch:

- Every rank draws the SAME minibatch permutation (one generator seed per step), and rank r
  takes the r-th contiguous slice of each global minibatch. The minibatches are therefore those
  of a single process whatever K is, so a run resumed with another K (checkpoints hold the full,
  rank-independent state) continues the same trajectory up to float reduction order.
- Loss normalisation: each micro-batch loss is a token sum divided by the GLOBAL minibatch token
  count (``all_reduce`` of the per-rank counts), as in the one-process update. DDP then AVERAGES
  gradients over the K ranks, which would divide the global gradient by K; the loss is multiplied
  by ``world_size`` before ``backward`` to compensate, so the synced gradient is the sum over all
  tokens / global token count -- the one-process gradient. Gradient clipping and the optimizer
  step then see identical gradients on every rank (parameters stay in sync without broadcasts).
- Logged update stats are reduced across ranks: the loss terms (partial sums over the global
  token count) are summed, ``ratio_max`` is a max, the rest (fractions, KL estimates) averaged.

gloo on CPU, NCCL on GPU (rank r on ``cuda:LOCAL_RANK``). With WORLD_SIZE unset or 1 nothing here
does anything: :class:`DistContext` () is the single-process context and ``ppo_update`` is the
plain one.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from refit.core.errors import RefitError

_DDP_ARGS = inspect.signature(DistributedDataParallel.__init__).parameters


class _DDP(DistributedDataParallel):
    """DDP that forwards unknown attributes (``config``, ``generation_config``) to the wrapped model."""

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return getattr(self.module, name)


@dataclass
class DistContext:
    """Where this process stands in the job; the default is the single-process context."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str = ""  # "gloo" | "nccl"; "" for a single process
    device: torch.device | None = None  # this rank's learner device (None: the config decides)
    policy_ddp: torch.nn.Module | None = None  # DDP wrappers used by the update only
    value_ddp: torch.nn.Module | None = None

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def wrap(self, policy: torch.nn.Module, value_head: torch.nn.Module | None = None) -> None:
        """DDP-wrap the policy (and the value head, if any); syncs rank 0's parameters to all ranks."""
        if not self.enabled:
            return
        ids = [self.local_rank] if self.backend == "nccl" else None
        # no buffer sync in forward: rank 0 runs forward passes (experience, probe) alone on the raw
        # modules, and the models' buffers (rotary tables, masks) are constants anyway. torch >= 2.13
        # names it forward_sync_buffers (broadcast_buffers is deprecated there).
        no_sync = "forward_sync_buffers" if "forward_sync_buffers" in _DDP_ARGS else "broadcast_buffers"
        kw = {"device_ids": ids, "find_unused_parameters": False, no_sync: False}
        self.policy_ddp = _DDP(policy, **kw)
        self.value_ddp = _DDP(value_head, **kw) if value_head is not None else None

    def share(self, obj):
        """Rank 0's ``obj`` (any picklable object: tensors travel on the CPU) on every rank; no-op for one process."""
        if not self.enabled:
            return obj
        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0, device=self.device if self.backend == "nccl" else None)
        return box[0]

    def no_sync(self, sync: bool):
        """DDP's no_sync on the wrappers unless ``sync`` (the last micro-batch); nothing for one process."""
        stack = contextlib.ExitStack()
        if not sync:
            for m in (self.policy_ddp, self.value_ddp):
                if m is not None:
                    stack.enter_context(m.no_sync())
        return stack

    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """All-reduce a CPU tensor (moved through the device under NCCL); returns a CPU tensor."""
        if not self.enabled:
            return t
        x = t.to(self.device) if self.backend == "nccl" else t.clone()
        dist.all_reduce(x, op=op)
        return x.cpu()

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def close(self) -> None:
        """Wait for every rank (unless an exception is on its way out), then leave the process group.

        After a failure on rank 0 the other ranks wait in a broadcast; torchrun ends them when
        rank 0 exits non-zero, so no barrier is attempted then.
        """
        if self.enabled and dist.is_initialized():
            if sys.exc_info()[0] is None:
                dist.barrier()
            dist.destroy_process_group()


def init_from_env(device: str = "auto", timeout_s: float = 1800.0) -> DistContext:
    """The context of this process from torchrun's RANK / WORLD_SIZE / LOCAL_RANK (env:// rendezvous).

    NCCL when the learner runs on CUDA (``device`` "cuda", or "auto" with a GPU), gloo otherwise.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistContext()
    try:
        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    except KeyError:
        raise RefitError("WORLD_SIZE > 1 but RANK is not set: launch with torchrun --nproc-per-node K") from None
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if cuda:
        torch.cuda.set_device(local)
    backend = "nccl" if cuda else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return DistContext(rank=rank, world_size=world, local_rank=local, backend=backend,
                       device=torch.device("cuda", local) if cuda else torch.device("cpu"))


def reduce_stats(ctx: DistContext, stats: dict[str, float], sums: tuple[str, ...] = (),
                 maxes: tuple[str, ...] = ()) -> dict[str, float]:
    """Per-rank update stats -> job stats: ``sums`` added, ``maxes`` maxed, the rest averaged."""
    if not ctx.enabled:
        return stats
    keys = sorted(stats)
    vals = torch.tensor([stats[key] for key in keys], dtype=torch.float64)
    total = ctx.all_reduce(vals, dist.ReduceOp.SUM)
    top = ctx.all_reduce(vals, dist.ReduceOp.MAX)
    out = {}
    for i, key in enumerate(keys):
        out[key] = float(top[i]) if key in maxes else float(total[i]) / (1 if key in sums else ctx.world_size)
    return out


__all__ = ["DistContext", "init_from_env", "reduce_stats"]
