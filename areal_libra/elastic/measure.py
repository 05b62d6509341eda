"""What the elastic policy reads, from what a trainer can measure (one implementation for the simulator and
the live run).

T_rollout: the time the rollout side needs to produce one training batch.
- With the rollout side's idle time measured (`idle_s`, `RolloutIdleClock`: the time in the step during
  which no rollout was in flight, because AReaL's staleness bound held the next ones back) and the step's
  wall time: the rollout side was busy `interval - idle` of the step and the trainer `interval - wait`, and
  T_rollout is the train time scaled by the first over the second (floored at IDLE_FLOOR of it). This holds
  whichever side is ahead: a trainer that never waits sees rollout idle for the share it is ahead; one that
  waits for a batch while rollout never idles sees T_rollout = T_train + wait, as below. A trainer can wait
  while rollout idles too: at max_head_offpolicyness=1 the next batch may start only after the weight
  update, so the last groups of a batch often arrive after the trainer asks although rollout then idles
  most of the step; the wait is the pipeline's, not rollout's capacity, and only the busy time says so.
  With a small staleness bound this is the only signal of a rollout side that is ahead: no backlog beyond
  the next batch ever forms, so a backlog-only rule reads T_rollout >= T_train however idle rollout was.
- Without it (the simulator): when the trainer had to wait for its batch, rollout produced one batch in the
  whole iteration: T_rollout = T_train + wait; when the batch was already there, rollout is ahead by the
  share of finished groups waiting beyond this batch (`backlog`): T_rollout < T_train (floored at half of
  it: a large backlog says rollout is fast, not how fast).

Pressure: from the rollout servers' own counts, sampled during the step. queue = waiting / (waiting +
running): requests that a server could not admit yet; active = (running + waiting) / capacity (the
servers' max running requests): how full the rollout side is.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

# A wait shorter than this share of the train time is noise (the last group finishing as the trainer
# asks), not rollout falling behind.
WAIT_NOISE = 0.02
# With the idle time measured, T_rollout is floored at this share of T_train (T_train/T_rollout <= 10): the
# measurement says how idle rollout was; below this it is noise around a near-zero busy time.
IDLE_FLOOR = 0.1


def rollout_time(train_s: float, wait_s: float, backlog: int, batch: int, waited_for_count: bool = True,
                 idle_s: float | None = None, interval_s: float | None = None) -> float:
    """T_rollout from the train time of the step, the trainer's wait for its batch, the finished groups
    left over beyond the batch and, when measured, the rollout side's idle time in a step of `interval_s`.
    `waited_for_count`: the wait was for the batch to fill (not, e.g., for a straggler a staleness bound
    forces into it)."""
    if idle_s is not None and interval_s is not None and interval_s > 0:
        busy = max(0.0, interval_s - max(0.0, idle_s))
        cycle = max(1e-9, interval_s - max(0.0, wait_s))
        return max(IDLE_FLOOR * train_s, train_s * busy / cycle)
    if waited_for_count and wait_s > WAIT_NOISE * train_s:
        return train_s + wait_s
    return train_s * max(0.5, 1.0 - backlog / max(1, batch))


class RolloutIdleClock:
    """Time during which no rollout was in flight, from the in-flight count's changes (`on_change` with the
    new count after every submit / finish). `take()` returns the idle seconds since the previous take."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self._lock = threading.Lock()
        self._running = 0
        self._idle_since: float | None = now()
        self._idle = 0.0

    def on_change(self, running: int) -> None:
        with self._lock:
            t = self._now()
            if running <= 0 and self._idle_since is None:
                self._idle_since = t
            elif running > 0 and self._idle_since is not None:
                self._idle += t - self._idle_since
                self._idle_since = None
            self._running = running

    def take(self) -> float:
        with self._lock:
            t = self._now()
            idle = self._idle
            if self._idle_since is not None:
                idle += t - self._idle_since
                self._idle_since = t
            self._idle = 0.0
            return idle


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
