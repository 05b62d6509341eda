"""Libra's working-set admission in the live trainer: AReaL's executor starts a new group only while the running
trajectories' contexts fit the rollout servers' KV cache, by the rule the simulator runs (cmlfq.aging.admit_group,
sim/cluster.py under RunConfig.working_set_admission). AReaL 1.0.4 admits by the staleness bound alone; patch 17
(patches/areal-1.0.4/17-admission-gate.patch) gives its dispatcher an `admit_gate` hook, asked before each
submission. The working set is the router's (rollout/router.py `working_tokens`), the capacity the servers' own
`max_total_num_tokens` as the pressure sampler last read it (rollout/pressure.py), the elastic hybrids' servers
left out (the pool takes them back at any step: the fleet's `hybrid_addresses`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from areal_libra.cmlfq.aging import admit_group
from areal_libra.live.lag_bound import NotPatched, dispatcher_of


class WorkingSetGate:
    """The executor's gate: admit while the working set fits; always admit while no server reports its KV size
    (a server that does not say cannot be full by this rule). `held` counts the answers that held a group back
    (the executor asks again every admit_gate_poll_s while it waits)."""

    def __init__(self, working_tokens: Callable[[], int], kv_capacity: Callable[[], int]) -> None:
        self.working_tokens, self.kv_capacity = working_tokens, kv_capacity
        self.held = 0

    def __call__(self) -> bool:
        cap = self.kv_capacity()
        if cap <= 0 or admit_group(self.working_tokens(), cap):
            return True
        self.held += 1
        return False

    def metrics(self) -> dict[str, float]:
        return {"libra/admission_held_polls": float(self.held)}


def install(rollout: Any, router: Any, sampler: Any) -> WorkingSetGate | None:
    """Gate the trainer's executor on the router's working set and the sampler's KV capacity; None where there
    is no local executor. NotPatched (one line: what to run) when AReaL lacks patch 17."""
    found = dispatcher_of(rollout)
    if found is None:
        return None
    dispatcher, eta = found
    if not hasattr(dispatcher, "admit_gate"):
        raise NotPatched("libra.working_set_admission needs AReaL patch 17 (admission gate): run "
                         "`python -m areal_libra.patches apply`")
    # A trajectory more than eta + 1 versions old has been trained (the lag bound) or failed: not in the set.
    gate = WorkingSetGate(lambda: router.working_tokens(max_lag=eta + 1), sampler.kv_capacity)
    dispatcher.admit_gate = gate
    return gate
