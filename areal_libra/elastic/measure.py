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

Pressure (`pressure`, one definition for the live sampler, rollout/pressure.py, and the simulator): how
full the rollout side is, from the serving servers' own counts at one instant, summed over the servers.
- active pressure: the fraction of the rollout side's capacity in use. A server admits a request only
  while it has both a free request slot (max_running_requests) and room for its context in the KV cache
  (max_total_num_tokens), so capacity is whichever binds first: max(running / max_running, resident KV
  tokens / KV capacity). Libra's "active rollout pressure" (re-plan at >= 0.85; the elastic policy gives
  hybrids back to rollout at >= 0.80): the servers are nearly full, more requests would queue.
- queue pressure: waiting / (waiting + running), the share of the requests on the servers that they
  could not admit yet (Libra re-plans at >= 0.75).
A step's pressure is the mean over the instants sampled in it (live: every second of the step; the
simulator: the step's end).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import NamedTuple

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


class ServerLoad(NamedTuple):
    """One rollout server's counts at one instant (SGLang's /server_info; a simulated server's state)."""

    running: int  # requests in the running batch
    waiting: int  # requests on the server not admitted yet
    max_running: int  # request slots (max_running_requests)
    kv_used: int = 0  # KV-cache tokens held by the running requests
    kv_capacity: int = 0  # KV-cache tokens the server can hold; 0: not reported (slots only)


class Pressure(NamedTuple):
    queue: float  # waiting / (waiting + running)
    active: float  # fraction of the capacity in use: the tighter of request slots and KV tokens


def pressure(servers: Iterable[ServerLoad]) -> Pressure:
    """The rollout side's pressure at one instant, over the serving servers (module docstring): queue =
    waiting / (waiting + running); active = max(running / max_running, kv_used / kv_capacity) on the sums
    over the servers (KV over those that report it), capped at 1. (0, 0) without servers."""
    running = waiting = slots = kv = kv_cap = 0
    for s in servers:
        running += s.running
        waiting += s.waiting
        slots += s.max_running
        if s.kv_capacity > 0:
            kv += s.kv_used
            kv_cap += s.kv_capacity
    active = max(running / slots if slots else 0.0, kv / kv_cap if kv_cap else 0.0)
    return Pressure(waiting / max(1, waiting + running), min(1.0, active))


def mean_pressure(samples: Iterable[Pressure]) -> Pressure:
    """A step's pressure: the mean of the instants sampled in it; (0, 0) without samples."""
    q = a = 0.0
    n = 0
    for p in samples:
        q += p.queue
        a += p.active
        n += 1
    return Pressure(q / n, a / n) if n else Pressure(0.0, 0.0)


def rollout_busy_share(busy_gpu_s: float, interval_s: float, rollout_gpus: int) -> float:
    """The rollout side's measured use over one step: the accelerator-seconds its servers spent serving
    (a server's busy time x its TP, summed) over the step's interval x the rollout accelerators, capped at 1
    (StepObservation.rollout_busy, the calibrated gate's measured-use check). The simulator's servers and the
    emulated host's count their busy time the same way (sim.server.RolloutServer.busy_s; the host, which reads at
    any moment, adds the running chunk's part: RolloutServer.busy_at)."""
    return min(1.0, max(0.0, busy_gpu_s) / max(1e-9, interval_s * max(1, rollout_gpus)))
