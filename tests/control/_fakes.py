"""A cluster fake's elastic side for the controller tests: no hybrid pool (never joins or releases)."""

from __future__ import annotations

from areal_libra.control import PoolView


class NoElasticPool:
    def pool(self) -> PoolView:
        return PoolView(training=0, idle=0, train_replicas=4, rollout_gpus=4, unit_gpus=1)

    def join(self, n: int, step: int) -> int:
        return 0

    def release(self, n: int, step: int) -> int:
        return 0
