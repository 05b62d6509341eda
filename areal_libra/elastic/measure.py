"""What the elastic policy reads, from what a trainer can measure (one implementation for the simulator and
the live run).

T_rollout: the time one training batch takes to arrive from the rollout side. A trainer sees it only
indirectly: when it had to wait for the batch, T_rollout = T_train + wait (rollout produced one batch in
the whole iteration); when the batch was already there, rollout is ahead by the share of finished groups
waiting beyond this batch (`backlog`), so T_rollout < T_train (floored at half of it: a large backlog
says rollout is fast, not how fast).

Pressure: from the rollout servers' own counts, sampled during the step. queue = waiting / (waiting +
running): requests that a server could not admit yet; active = (running + waiting) / capacity (the
servers' max running requests): how full the rollout side is.
"""

from __future__ import annotations

from collections.abc import Iterable

# A wait shorter than this share of the train time is noise (the last group finishing as the trainer
# asks), not rollout falling behind.
WAIT_NOISE = 0.02


def rollout_time(train_s: float, wait_s: float, backlog: int, batch: int, waited_for_count: bool = True) -> float:
    """T_rollout from the train time of the step, the trainer's wait for its batch and the finished groups
    left over beyond the batch. `waited_for_count`: the wait was for the batch to fill (not, e.g., for a
    straggler a staleness bound forces into it)."""
    if waited_for_count and wait_s > WAIT_NOISE * train_s:
        return train_s + wait_s
    return train_s * max(0.5, 1.0 - backlog / max(1, batch))


def pressures(samples: Iterable[tuple[int, int, int]]) -> tuple[float, float]:
    """(queue_pressure, active_pressure) averaged over samples of (running, waiting, capacity) summed over
    the serving rollout servers; (0, 0) without samples."""
    q = a = 0.0
    n = 0
    for running, waiting, capacity in samples:
        q += waiting / max(1, waiting + running)
        a += min(1.0, (running + waiting) / max(1, capacity))
        n += 1
    return (q / n, a / n) if n else (0.0, 0.0)
