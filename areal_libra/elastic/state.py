"""Pool bookkeeping and the hybrid-replica state machine (pure, no I/O).

A hybrid replica is one or more ranks forming a complete copy of the core replica's TP/PP layout; it
changes state only as a whole. Every accepted transition bumps nothing except where a new attempt
starts (a join request, a release request, a rollback): then the generation counter increases, and any
message that carries an older generation is a no-op. That is how a late "fetched" from a cancelled join
can never activate a replica.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class ReplicaState(enum.StrEnum):
    ROLLOUT = "rollout"  # serving rollout requests
    REQUESTED = "requested"  # asked to join; draining its rollout server
    FETCHING = "fetching"  # outside the domain: fetching the snapshot, replaying the logged gradients
    ZERO_SYNC = "zero_sync"  # in the domain with weight 0 (zeros), replaying up to the live step
    ACTIVATING = "activating"  # aligned with the core; real gradients from the next step
    TRAINING = "training"  # contributes real gradients
    RELEASING = "releasing"  # leaving the domain; a rollout server is being started


JOINING = (ReplicaState.REQUESTED, ReplicaState.FETCHING, ReplicaState.ZERO_SYNC, ReplicaState.ACTIVATING)
# FETCHING happens outside the domain (the core never waits for a fetch); from ZERO_SYNC on the replica
# takes part in every reduction, with zeros until it trains.
IN_DOMAIN = (ReplicaState.ZERO_SYNC, ReplicaState.ACTIVATING, ReplicaState.TRAINING)
# While any replica is here, the core logs each step's reduced gradient so the replica can replay it.
CATCHING_UP = (ReplicaState.FETCHING, ReplicaState.ZERO_SYNC, ReplicaState.ACTIVATING)

# Forward edges of the join/release cycle; cancel and fail are handled separately (always to ROLLOUT).
_EDGES: dict[ReplicaState, tuple[ReplicaState, ...]] = {
    ReplicaState.ROLLOUT: (ReplicaState.REQUESTED,),
    ReplicaState.REQUESTED: (ReplicaState.FETCHING,),
    ReplicaState.FETCHING: (ReplicaState.ZERO_SYNC,),
    ReplicaState.ZERO_SYNC: (ReplicaState.ACTIVATING,),
    ReplicaState.ACTIVATING: (ReplicaState.TRAINING,),
    ReplicaState.TRAINING: (ReplicaState.RELEASING,),
    ReplicaState.RELEASING: (ReplicaState.ROLLOUT,),
}
# Transitions that begin a new attempt and therefore a new generation.
_NEW_GENERATION = {(ReplicaState.ROLLOUT, ReplicaState.REQUESTED), (ReplicaState.TRAINING, ReplicaState.RELEASING)}


@dataclass
class HybridReplica:
    rid: str
    n_ranks: int = 1
    state: ReplicaState = ReplicaState.ROLLOUT
    generation: int = 0
    history: list[tuple[int, str, str]] = field(default_factory=list)  # (generation, from, to)
    alive: bool = True

    def advance(self, to: ReplicaState, generation: int) -> bool:
        """Move to `to` if the edge exists and `generation` is current; returns whether it moved."""
        if generation != self.generation or not self.alive:
            return False
        if to not in _EDGES[self.state]:
            return False
        if (self.state, to) in _NEW_GENERATION:
            self.generation += 1
        self.history.append((self.generation, self.state.value, to.value))
        self.state = to
        return True

    def rollback(self, generation: int, reason: str) -> bool:
        """Cancel or failure: the whole replica goes back to ROLLOUT under a new generation."""
        if generation != self.generation or self.state == ReplicaState.ROLLOUT:
            return False
        self.history.append((self.generation, self.state.value, f"rollout ({reason})"))
        self.generation += 1
        self.state = ReplicaState.ROLLOUT
        return True


@dataclass
class PoolCounters:
    joins: int = 0
    releases: int = 0
    rollbacks: int = 0
    failures: int = 0


class Pool:
    """The three pools: fixed core training and core rollout sizes, plus the hybrid replicas."""

    def __init__(self, core_train_replicas: int, core_rollout_servers: int, hybrid: list[HybridReplica]) -> None:
        if len({h.rid for h in hybrid}) != len(hybrid):
            raise ValueError("hybrid replica ids must be unique")
        self.core_train_replicas = core_train_replicas
        self.core_rollout_servers = core_rollout_servers
        self.hybrid: dict[str, HybridReplica] = {h.rid: h for h in hybrid}
        self.counters = PoolCounters()

    def in_state(self, *states: ReplicaState) -> list[HybridReplica]:
        return [h for h in self.hybrid.values() if h.state in states and h.alive]

    def request_join(self, rid: str) -> int | None:
        """Returns the new generation, or None when the replica cannot join now."""
        h = self.hybrid[rid]
        return h.generation if h.advance(ReplicaState.REQUESTED, h.generation) else None

    def request_release(self, rid: str) -> int | None:
        h = self.hybrid[rid]
        if h.state in JOINING:
            # Releasing a replica that has not finished joining is a cancel.
            return h.generation if self.cancel(rid, h.generation, "released while joining") else None
        return h.generation if h.advance(ReplicaState.RELEASING, h.generation) else None

    def advance(self, rid: str, to: ReplicaState, generation: int) -> bool:
        h = self.hybrid[rid]
        moved = h.advance(to, generation)
        if moved and to == ReplicaState.TRAINING:
            self.counters.joins += 1
        if moved and to == ReplicaState.ROLLOUT:
            self.counters.releases += 1
        return moved

    def cancel(self, rid: str, generation: int, reason: str = "cancel") -> bool:
        moved = self.hybrid[rid].rollback(generation, reason)
        self.counters.rollbacks += int(moved)
        return moved

    def fail(self, rid: str, generation: int, reason: str = "failed") -> bool:
        """A dead replica is rolled back and marked not alive until it re-registers."""
        h = self.hybrid[rid]
        if generation != h.generation:
            return False
        if h.state != ReplicaState.ROLLOUT:
            self.counters.rollbacks += int(h.rollback(generation, reason))
        h.alive = False
        self.counters.failures += 1
        return True

    def revive(self, rid: str) -> None:
        self.hybrid[rid].alive = True

    def to_state(self) -> dict:
        """The pool's bookkeeping as JSON (the replicas' states and generations, the counters)."""
        return {"core_train_replicas": self.core_train_replicas, "core_rollout_servers": self.core_rollout_servers,
                "hybrid": [{"rid": h.rid, "n_ranks": h.n_ranks, "state": h.state.value, "generation": h.generation,
                            "alive": h.alive} for h in self.hybrid.values()],
                "counters": dict(vars(self.counters))}

    @classmethod
    def from_state(cls, state: dict) -> Pool:
        """The pool `to_state` described; ValueError when the state is malformed."""
        try:
            pool = cls(int(state["core_train_replicas"]), int(state["core_rollout_servers"]),
                       [HybridReplica(str(h["rid"]), int(h["n_ranks"]), ReplicaState(h["state"]),
                                      int(h["generation"]), alive=bool(h["alive"])) for h in state["hybrid"]])
            pool.counters = PoolCounters(**{k: int(v) for k, v in state["counters"].items()})
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"bad pool state: {e!r}") from None
        return pool

    def metrics(self, prefix: str = "elastic/") -> dict[str, float]:
        out: dict[str, float] = {f"{prefix}core_train_replicas": float(self.core_train_replicas),
                                 f"{prefix}core_rollout_servers": float(self.core_rollout_servers)}
        for s in ReplicaState:
            out[f"{prefix}n_{s.value}"] = float(len(self.in_state(s)))
        out[f"{prefix}n_dead"] = float(sum(not h.alive for h in self.hybrid.values()))
        out[f"{prefix}joins"] = float(self.counters.joins)
        out[f"{prefix}releases"] = float(self.counters.releases)
        out[f"{prefix}rollbacks"] = float(self.counters.rollbacks)
        out[f"{prefix}failures"] = float(self.counters.failures)
        return out
