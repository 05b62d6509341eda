"""Load-aware spill-over between TP buckets (a switch on top of any routing policy).

The planner sizes each bucket's servers for the requests whose *final* length falls in it, but a routing
policy only sees a prefix of each trajectory, so work can pile up in fewer buckets than planned. When the
bucket a policy picks is much more loaded (per GPU) than the one below it or any larger one, the request goes
there instead. Only placements spill (a start, or a move the policy already decided): a request that stays keeps
its server and its cached context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SpillConfig:
    ratio: float = 1.5  # spill when the target's load exceeds ratio x the neighbour's ...
    slack: float = 1.0  # ... plus this much (load units per GPU), so light load never spills
    reach: int = 1  # look at buckets at most this many positions below the target ...
    # ... and at every larger bucket, whose servers hold longer contexts. Looking only one position up stranded
    # work when that neighbour was as full as the target: DAPO-Math at 128 x 16 (seed 1) re-planned to one TP1,
    # one TP2 and five TP4 servers; every start went to the TP1 and TP2 buckets (2,300 and 3,900 requests
    # queued) while the TP4 bucket two positions up had 100 per GPU, and steps took 8,000-11,600 s, not 850.
    up_any: bool = True

    def __post_init__(self) -> None:
        if self.ratio < 1.0 or self.slack < 0.0 or self.reach < 1:
            raise ValueError(f"spill needs ratio >= 1, slack >= 0, reach >= 1, got {self}")


def spill(target: int, loads: Sequence[float], cfg: SpillConfig) -> int:
    """The bucket to place on: `target`, or the least-loaded bucket within `reach` below it or (up_any) any
    bucket above it when the target's load exceeds ratio * that load + slack. Ties go to the nearer bucket,
    then the larger (it has room for longer contexts)."""
    n = len(loads)
    if not 0 <= target < n:
        return target
    top = n if cfg.up_any else min(n, target + cfg.reach + 1)
    best, best_key = target, (loads[target], 0, -target)
    for b in range(max(0, target - cfg.reach), top):
        if b == target:
            continue
        key = (loads[b], abs(b - target), -b)
        if loads[target] > cfg.ratio * loads[b] + cfg.slack and key < best_key:
            best, best_key = b, key
    return best
