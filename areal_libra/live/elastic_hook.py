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

Batch sharing: when the step's plan has hybrid replicas in "training", the hook splits the batch that
`train_batch` receives into 1 + k contiguous shards of sequences, keeps the first and hands shard i to
hybrid i (a file `batches/b<step>_<rid>_p<position>.pt` next to the snapshots, with the loss function);
the hybrid's `AReaLEngineReplica` runs forward/backward on it with the same engine code. The token-weighted
domain mean then equals the full-batch token mean (up to float reassociation), and the core's step gets
shorter. Assumes one optimizer step per train step (`ppo_n_minibatches: 1`, the embedded default): the
hybrid steps its lr scheduler after each update, as the trainer does after each `ppo_update`.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from typing import Any

import torch

from areal_libra.elastic_runtime.core import ElasticCore


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
        self.before_step: Any = None  # callback(step, last train_batch seconds), e.g. the policy
        self.share_batches = True
        self.last_train_s = 0.0

    # -- installation ----------------------------------------------------------------------------
    @classmethod
    def install(cls, engine: Any, core: ElasticCore, start_step: int = 0, share_batches: bool = True
                ) -> FSDPElasticHook:
        """share_batches=False: training hybrids bring their own data (the core keeps its whole batch)."""
        hook = cls(engine, core, start_step)
        hook.share_batches = share_batches
        cls._patch_weight()
        cls._current = hook
        original_step = engine.optimizer_step

        def optimizer_step() -> dict[str, float]:
            hook.before_optimizer_step()
            return original_step()

        original_train = engine.train_batch

        def train_batch(input_: Any, loss_fn: Any, loss_weight_fn: Any) -> dict[str, float]:
            if hook.before_step is not None:
                hook.before_step(hook.step, hook.last_train_s)  # policy decisions at the step boundary
            t0 = time.perf_counter()
            try:
                return original_train(hook.share_batch(input_, loss_fn, loss_weight_fn), loss_fn, loss_weight_fn)
            finally:
                hook.last_train_s = time.perf_counter() - t0

        engine.optimizer_step = optimizer_step  # instance attributes: only this engine is affected
        engine.train_batch = train_batch
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

    def share_batch(self, input_: Any, loss_fn: Any, loss_weight_fn: Any) -> Any:
        """Keep this replica's shard of the step's batch; write the others for the training hybrids."""
        plan = self.core.begin_step(self.step)
        trainers = sorted(rid for rid, st in plan["states"].items() if st == "training")
        if not trainers or not self.share_batches or not isinstance(input_, dict):
            return input_
        shards = split_batch(input_, 1 + len(trainers))
        for rid, shard in zip(trainers, shards[1:]):
            write_shard(batch_dir(self.core.snapshots.root), self.step, rid, self.core.rank, shard, loss_fn,
                        loss_weight_fn)
        return shards[0]

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


# -- batch sharing ---------------------------------------------------------------------------------
def batch_dir(snapshot_root: str) -> str:
    d = os.path.join(snapshot_root, "batches")
    os.makedirs(d, exist_ok=True)
    return d


def _shard_path(d: str, step: int, rid: str, position: int) -> str:
    return os.path.join(d, f"b{step:08d}_{rid}_p{position}.pt")


def split_batch(input_: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """n contiguous shards of a padded batch dict (tensors with the batch on dim 0); may be empty."""
    bs = int(input_["attention_mask"].shape[0])
    bounds = [round(i * bs / n) for i in range(n + 1)]
    out = []
    for a, b in zip(bounds, bounds[1:]):
        out.append({k: (v[a:b] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == bs else v)
                    for k, v in input_.items()})
    return out


def loss_mask_count(mb: dict[str, Any]) -> torch.Tensor:
    """AReaL's PPO actor weighs micro-batches by this (it passes it as a lambda, which cannot travel)."""
    return mb["loss_mask"].count_nonzero()


def _portable(fn: Any, fallback: Any) -> Any:
    try:
        pickle.dumps(fn)
        return fn
    except Exception:  # noqa: BLE001 - lambdas and closures do not pickle
        return fallback


def write_shard(d: str, step: int, rid: str, position: int, shard: dict[str, Any], loss_fn: Any,
                loss_weight_fn: Any) -> None:
    path = _shard_path(d, step, rid, position)
    tmp = f"{path}.tmp"
    torch.save({"input": shard, "loss_fn": _portable(loss_fn, None),
                "loss_weight_fn": _portable(loss_weight_fn, loss_mask_count)}, tmp)
    os.replace(tmp, path)


class AReaLEngineReplica:
    """ReplicaAdapter for a hybrid replica built on an AReaL FSDPEngine (same config as the core)."""

    def __init__(self, engine: Any, snapshot_root: str, rid: str, position: int = 0,
                 timeout_s: float = 600.0) -> None:
        self.engine, self.rid, self.position, self.timeout_s = engine, rid, position, timeout_s
        self.dir = batch_dir(snapshot_root)
        self._hook = FSDPElasticHook(engine, core=None)  # type: ignore[arg-type] - state helpers only

    def grad_tensors(self) -> list[torch.Tensor]:
        return self._hook.grad_tensors()

    def compute_gradients(self, step: int) -> float:
        import areal.engine.fsdp_engine as fe

        path = _shard_path(self.dir, step, self.rid, self.position)
        deadline = time.monotonic() + self.timeout_s
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no batch shard {path}")
            time.sleep(0.005)
        blob = torch.load(path, weights_only=False)
        os.remove(path)
        e = self.engine
        e.optimizer_zero_grad()
        if blob["loss_fn"] is None or int(blob["input"]["attention_mask"].shape[0]) == 0:
            for g in self.grad_tensors():
                g.zero_()
            return 0.0
        loss_fn, weight_fn = blob["loss_fn"], blob["loss_weight_fn"]
        batched, _ = e._normalize_batch_input(blob["input"])
        mb_list = e._prepare_mb_list(batched).to(e.device)
        total = fe.compute_total_loss_weight(mb_list, weight_fn, e.dp_group)

        def process_output(logits: torch.Tensor, ctx_dict: dict[str, Any]) -> torch.Tensor:
            return e._compute_logprobs_and_loss(logits, fe.FSDPTrainContext(**ctx_dict), loss_fn, weight_fn, total,
                                                loss_multiplier=e.parallel_helper.dp_size)

        e.forward_backward_batch(mb_list, process_output, forward_only=False)
        return float(total)

    def apply_update(self) -> dict[str, float]:
        stats = self.engine.optimizer_step()
        self.engine.lr_scheduler_step()
        return stats

    def state(self) -> dict[str, Any]:
        return self._hook.state()

    def load_state(self, state: dict[str, Any]) -> None:
        self._hook.load_state(state)
