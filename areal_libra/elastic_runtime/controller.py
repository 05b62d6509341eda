"""Applies the policy to the pool: measured times in, join/release requests out (leader only)."""

from __future__ import annotations

from typing import Any

from areal_libra.elastic.policy import Decision, ElasticPolicy
from areal_libra.elastic.state import JOINING, ReplicaState
from areal_libra.elastic_runtime.core import ElasticCore


class ElasticController:
    def __init__(self, core: ElasticCore, policy: ElasticPolicy) -> None:
        if not core.is_leader:
            raise ValueError("the controller runs on core rank 0 (the leader)")
        self.core = core
        self.policy = policy
        self.steps_since_change: int | None = None
        self.decisions: list[Decision] = []

    def _counts(self) -> tuple[list[str], list[str]]:
        pool = self.core.pool
        active = sorted(h.rid for h in pool.in_state(ReplicaState.TRAINING))
        idle = sorted(h.rid for h in pool.in_state(ReplicaState.ROLLOUT))
        return active, idle

    def _busy(self) -> bool:
        # One transition at a time: a join in flight has not changed the measured times yet.
        return bool(self.core.pool.in_state(*JOINING, ReplicaState.RELEASING))

    def on_step(self, t_train_s: float, t_rollout_s: float, rollout_pressure: float,
                plan: Any = None, core_dp: int | None = None) -> Decision:
        active, idle = self._counts()
        if self._busy():
            d = Decision("hold", 0, "a transition is in flight")
        elif plan is not None:
            d = self.policy.request_from_plan(plan, len(active), len(idle), core_dp)
        else:
            d = self.policy.decide(t_train_s, t_rollout_s, rollout_pressure, len(active), len(idle),
                                   self.steps_since_change)
        done = 0
        if d.action == "join":
            done = sum(self.core.request_join(rid) for rid in idle[: d.n])
        elif d.action == "release":
            # Newest first would need join times; releasing in reverse id order is deterministic.
            done = sum(self.core.request_release(rid) for rid in sorted(active, reverse=True)[: d.n])
        if done:
            self.steps_since_change = 0
        elif self.steps_since_change is not None:
            self.steps_since_change += 1
        self.decisions.append(d)
        return d
