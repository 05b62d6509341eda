"""AReaL integration (core side): reduce an FSDPEngine's gradients over the elastic domain before each
optimizer step, publish its snapshots, and report `elastic/*` metrics.

    hook = FSDPElasticHook.install(engine, core)        # core = ElasticCore(...) for this rank
    metrics.add_source(hook.step_metrics)                # per-step elastic/* keys in metrics.jsonl

What the hook does, per optimizer step of the engine:
  1. AReaL's `train_batch` computes the token weight of the step (`compute_total_loss_weight`, already
     all-reduced over the core's DP group); the hook records it as the core replica's data weight.
  2. Backward leaves FSDP2-sharded gradients (DTensor); their local shards are this rank's position in
     the domain (core rank r <-> position r; a hybrid replica is the same FSDP layout on other devices).
  3. `ElasticCore.reduce_gradients` replaces them with sum_r w_r g_r / sum_r w_r over the domain; with no
     hybrid replica in the domain this is bitwise the engine's own gradient, so the hook is inert.
  4. AReaL's own `optimizer_step` (clipping, optimizer, per-layer step) runs unchanged.
The snapshot state is this rank's shard: local parameter shards, optimizer and lr-scheduler state.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from areal_libra.elastic.core import ElasticCore


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _local_tree(obj: Any) -> Any:
    """Optimizer state of an FSDP2 model holds DTensors; a snapshot stores this rank's local shards."""
    if isinstance(obj, torch.Tensor):
        return _local(obj.detach())
    if isinstance(obj, dict):
        return {k: _local_tree(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_local_tree(v) for v in obj)
    return obj


class FSDPElasticHook:
    _patch_lock = threading.Lock()
    _weight_patched = False
    _current: FSDPElasticHook | None = None

    def __init__(self, engine: Any, core: ElasticCore, start_step: int = 0) -> None:
        self.engine = engine
        self.core = core
        self.step = start_step
        self.weight: float | None = None
        self.last: dict[str, float] = {}

    # -- installation ----------------------------------------------------------------------------
    @classmethod
    def install(cls, engine: Any, core: ElasticCore, start_step: int = 0) -> FSDPElasticHook:
        hook = cls(engine, core, start_step)
        cls._patch_weight()
        cls._current = hook
        original_step = engine.optimizer_step

        def optimizer_step() -> dict[str, float]:
            hook.before_optimizer_step()
            return original_step()

        engine.optimizer_step = optimizer_step  # instance attribute: only this engine is affected
        core.state_fn = hook.state
        return hook

    @classmethod
    def _patch_weight(cls) -> None:
        # train_batch computes the step's total loss weight through this module-level function; wrapping
        # it is the one place where the exact (DP-all-reduced) token weight is visible.
        with cls._patch_lock:
            if cls._weight_patched:
                return
            import areal.engine.fsdp_engine as fe

            original = fe.compute_total_loss_weight

            def recorded(*args: Any, **kwargs: Any) -> torch.Tensor:
                total = original(*args, **kwargs)
                if cls._current is not None:
                    cls._current.weight = float(total)
                return total

            fe.compute_total_loss_weight = recorded
            cls._weight_patched = True

    # -- per step --------------------------------------------------------------------------------
    def grad_tensors(self) -> list[torch.Tensor]:
        grads = []
        for p in self.engine.model.parameters():
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(_local(p.grad))
        return grads

    def before_optimizer_step(self) -> None:
        weight = self.weight if self.weight is not None else 1.0
        self.last = self.core.reduce_gradients(self.step, self.grad_tensors(), weight)
        self.step += 1
        self.weight = None

    def step_metrics(self) -> dict[str, float]:
        return dict(self.last)

    def state(self) -> dict[str, Any]:
        e = self.engine
        out: dict[str, Any] = {
            "model": {n: _local(p.detach()) for n, p in e.model.named_parameters()},
            "optimizer": _local_tree(e.optimizer.state_dict()) if e.optimizer is not None else None,
            "step": self.step,
        }
        if getattr(e, "lr_scheduler", None) is not None:
            out["lr_scheduler"] = e.lr_scheduler.state_dict()
        return out

    def load_state(self, state: dict[str, Any]) -> None:
        """Used by a hybrid replica built on the same engine type (same FSDP layout)."""
        e = self.engine
        params = dict(e.model.named_parameters())
        with torch.no_grad():
            for n, t in state["model"].items():
                _local(params[n].data).copy_(t)
        if state.get("optimizer") is not None:
            # Local shards go back into the engine's own (DTensor) state in place, keeping its layout.
            own = e.optimizer.state_dict()
            _copy_into(own["state"], state["optimizer"]["state"])
            e.optimizer.load_state_dict(own)
        if state.get("lr_scheduler") is not None:
            e.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.step = int(state.get("step", self.step))


def _copy_into(dst: Any, src: Any) -> None:
    if isinstance(dst, dict):
        for k, v in dst.items():
            if isinstance(v, torch.Tensor):
                with torch.no_grad():
                    _local(v).copy_(src[k])
            else:
                _copy_into(v, src[k])
