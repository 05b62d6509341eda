"""Load-aware spill-over between TP buckets (a switch on top of any routing policy).

The planner sizes each bucket's servers for the requests whose *final* length falls in it, but a routing
policy only sees a prefix of each trajectory, so work can pile up in fewer buckets than planned. When the
bucket a policy picks is much more loaded (per GPU) than a nearby one, the request goes to the nearby one
instead. Only placements spill (a start, or a move the policy already decided): a request that stays keeps
its server and its cached context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SpillConfig:
    ratio: float = 1.5  # spill when the target's load exceeds ratio x the neighbour's ...
    slack: float = 1.0  # ... plus this much (load units per GPU), so light load never spills
    reach: int = 1  # look at buckets at most this many positions away

    def __post_init__(self) -> None:
        if self.ratio < 1.0 or self.slack < 0.0 or self.reach < 1:
            raise ValueError(f"spill needs ratio >= 1, slack >= 0, reach >= 1, got {self}")


def spill(target: int, loads: Sequence[float], cfg: SpillConfig) -> int:
    """The bucket to place on: `target`, or the least-loaded bucket within `reach` of it when the target's
    load exceeds ratio * that load + slack. Ties keep the larger bucket (it has room for longer contexts)."""
    n = len(loads)
    if not 0 <= target < n:
        return target
    best, best_load = target, loads[target]
    for b in range(max(0, target - cfg.reach), min(n, target + cfg.reach + 1)):
        if b == target:
            continue
        if loads[target] > cfg.ratio * loads[b] + cfg.slack and (loads[b], -b) < (best_load, -best):
            best, best_load = b, loads[b]
    return best
