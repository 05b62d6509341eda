"""What the elastic runtime needs from a training replica, and a plain nn.Module implementation of it.

Core replicas and hybrid replicas run the same replica code; the only difference is who they reduce
with. The post-reduce update (`apply_update`) must be deterministic, because a joining replica replays
the reduced gradients it received while catching up and must end up bitwise where the core is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from areal_libra.elastic_runtime.cpu_optim import without_cuda_check


class ReplicaAdapter(Protocol):
    def grad_tensors(self) -> list[torch.Tensor]:
        """This rank's gradient tensors (local shards), in an order identical on every replica."""
        ...

    def compute_gradients(self, step: int) -> float:
        """Forward/backward on this replica's data for `step` (replica-internal reduction included);
        returns the replica's data weight (samples or tokens)."""
        ...

    def apply_update(self) -> dict[str, float]:
        """Optimizer (and lr scheduler) step on the reduced gradients now in grad_tensors()."""
        ...

    def state(self) -> dict[str, Any]:
        ...

    def load_state(self, state: dict[str, Any]) -> None:
        ...


def ensure_grads(params: list[nn.Parameter]) -> list[torch.Tensor]:
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return [p.grad for p in params]


class ModuleReplica:
    """A replica rank holding a full copy of `model` (data parallel inside the replica over `group`)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[nn.Module, int], tuple[torch.Tensor, float]],
        scheduler: Any = None,
        group: Any = None,
        group_size: int = 1,
        clip_norm: float | None = 1.0,
    ) -> None:
        self.model = model
        self.optimizer = without_cuda_check(optimizer)  # a CPU replica never initialises CUDA
        self.scheduler = scheduler
        self.loss_fn = loss_fn  # (model, step) -> (loss averaged over this rank's data, rank data weight)
        self.group = group  # replica-internal DP group (a ProcessGroup or None when the replica is one rank)
        self.group_size = group_size
        self.clip_norm = clip_norm
        self.params = [p for p in model.parameters() if p.requires_grad]
        ensure_grads(self.params)

    def grad_tensors(self) -> list[torch.Tensor]:
        return ensure_grads(self.params)

    def compute_gradients(self, step: int) -> float:
        for p in self.params:
            p.grad = None
        loss, weight = self.loss_fn(self.model, step)
        loss.backward()
        grads = ensure_grads(self.params)
        if self.group is not None and self.group_size > 1:
            # Replica-internal mean: equal data per rank, so the mean is the replica's per-sample mean.
            flat = torch.cat([g.reshape(-1) for g in grads])
            _allreduce(self.group, flat)
            flat.div_(self.group_size)
            off = 0
            for g in grads:
                g.copy_(flat[off:off + g.numel()].view_as(g))
                off += g.numel()
            weight = weight * self.group_size
        self.last_loss = float(loss.detach())
        return float(weight)

    def apply_update(self) -> dict[str, float]:
        norm = float("nan")
        if self.clip_norm is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.clip_norm))
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        return {"grad_norm": norm}

    def set_flat_grads(self, flat: torch.Tensor) -> None:
        off = 0
        for g in ensure_grads(self.params):
            g.copy_(flat[off:off + g.numel()].view_as(g))
            off += g.numel()

    def state(self) -> dict[str, Any]:
        out = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        if self.scheduler is not None:
            out["scheduler"] = self.scheduler.state_dict()
        return out

    def load_state(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])

    def flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])


def _allreduce(group: Any, t: torch.Tensor) -> None:
    # Called on the ProcessGroup object itself: works for the default world and for standalone groups alike.
    group.allreduce([t]).wait()
