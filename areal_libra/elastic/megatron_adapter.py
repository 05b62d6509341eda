"""Megatron-Core adapter (GPU clusters): reduce a `megatron.core.distributed.DistributedDataParallel`
model's gradient buffers over the elastic domain, between `finish_grad_sync()` and the optimizer step.

Written to megatron-core 0.16.1's DDP grad-buffer API (`model.bucket_groups[*].buckets[*].grad_data`,
`ddp_config.use_distributed_optimizer`, `intra_distributed_optimizer_instance_rank/size`):

- Plain DDP: after `finish_grad_sync()` every DP rank of the core holds the full reduced bucket; the
  domain position is the rank's (tp, pp, dp) coordinate inside the replica, so each position reduces
  its whole buckets with the same position of every hybrid replica.
- Distributed optimizer (ZeRO-1): after the reduce-scatter only this rank's shard of each bucket is
  meaningful, so only that shard travels (shards line up because a hybrid replica has the same layout).

The core's TP/PP/DP groups are Megatron's own and are never touched. Requires CUDA for Megatron's
DDP itself (its buffers are allocated on the current CUDA device): on this CPU machine the module
imports (megatron-core 0.16.1 installs and imports) and `bucket_views` is tested on CPU tensors laid out
like Megatron's buckets; the full DDP path is GPU-only and untested here.
"""

from __future__ import annotations

from typing import Any

import torch

from areal_libra.elastic.core import ElasticCore


def bucket_views(bucket_groups: list[Any]) -> list[torch.Tensor]:
    """The gradient views this rank contributes, in a layout-determined order."""
    views = []
    for group in bucket_groups:
        sharded = bool(getattr(group.ddp_config, "use_distributed_optimizer", False))
        for bucket in group.buckets:
            g = bucket.grad_data
            if sharded:
                size = group.intra_distributed_optimizer_instance_size
                rank = group.intra_distributed_optimizer_instance_rank
                shard = g.numel() // size
                views.append(g[rank * shard:(rank + 1) * shard])
            else:
                views.append(g)
    return views


class MegatronElasticAdapter:
    def __init__(self, ddp_model: Any, core: ElasticCore, start_step: int = 0) -> None:
        self.model = ddp_model
        self.core = core
        self.step = start_step
        self.last: dict[str, float] = {}

    def grad_tensors(self) -> list[torch.Tensor]:
        groups = list(self.model.bucket_groups) + list(getattr(self.model, "expert_parallel_bucket_groups", []))
        return bucket_views(groups)

    def before_optimizer_step(self, weight: float) -> dict[str, float]:
        """Call after forward/backward of the step, before `optimizer.step()`; `weight` = tokens (or
        samples) behind this replica's gradient (Megatron averages over its own DP group first)."""
        self.model.finish_grad_sync()
        self.last = self.core.reduce_gradients(self.step, self.grad_tensors(), weight)
        self.step += 1
        return self.last
