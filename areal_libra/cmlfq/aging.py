"""Version aging: a rollout server serves the requests of older trajectories first (earliest deadline first).

Libra trains no trajectory more than eta policy versions after it started (the trainer waits for a group
that would otherwise exceed eta: `RunConfig.strict_staleness` in the simulator). Every trajectory thus has a
deadline, the training step start_version + eta; with one eta for all, earliest-deadline-first is
oldest-start-version-first. A server that admits its waiting requests in that order lets a straggler's next
segment (a tool return, a re-prefill after a migration) overtake the newly admitted prompts of later
versions, so the trainer rarely has to wait for it. Within one version the order stays first come, first
served.

One key for both sides:
- the simulator's server queue (areal_libra.sim.server.RolloutServer, `edf`) inserts by `priority`;
- a live SGLang server runs with SGLANG_FLAGS and each generate request carries `priority` (SGLang's own
  priority scheduler then orders its waiting queue the same way, lowest value first, FIFO on ties).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any, TypeVar

T = TypeVar("T")

# Libra bounds every trained trajectory's version lag by eta (the rule below at consumption, oldest start
# version first at the servers). One switch for the simulated Libra (sim/libra.py BOUND_LAG) and the live
# run's default (LibraConfig.bound_lag: the executor's consumption rule, request priority, SGLang flags).
BOUND_LAG = True

# SGLang (>= 0.5) server flags that make its waiting queue order requests by the request's `priority`,
# lowest value first, arrival order on ties (SchedulePolicy._sort_by_priority_and_fcfs, under the fcfs
# schedule policy); priority preemption off (the simulator's servers never preempt a running request for a
# waiting one of higher priority, only for KV room). The launcher passes them when the bound is on
# (launcher.libra_sglang_flags).
SGLANG_FLAGS: tuple[str, ...] = ("--schedule-policy", "fcfs", "--enable-priority-scheduling",
                                 "--schedule-low-priority-values-first", "--disable-priority-preemption")


# Libra starts a new group only while the contexts of the running trajectories (the working set: prompt,
# generated tokens and tool payloads so far, whether decoding, queued or waiting on a tool) fit the rollout
# servers' KV cache. Past that, a new group's requests evict the cached contexts of older trajectories waiting
# on a tool, whose next turn then re-prefills its whole context, and the servers thrash (R2E-Gym at 128 x
# 16: 115-255 M prefill tokens a step against 11-16 M, hundreds of retractions a step, the trainer waiting
# 800-2,600 s for stragglers at the bound).
WORKING_SET_ADMISSION = True


def admit_group(working_tokens: int, kv_capacity_tokens: int) -> bool:
    """May a new group start: the running trajectories' contexts fill less than the rollout KV capacity.
    The capacity is the servers' that stay: an Elastic Hybrid Pool worker's servers do not count, since the pool
    takes them back for training at any step and their contexts then re-prefill on the core's (R2E-Gym at 128 x
    16: counting the hybrids lent through the pipeline's fill cost the +elastic rung 4.8%)."""
    return working_tokens < kv_capacity_tokens


def priority(start_version: int) -> int:
    """The request's scheduling priority (lower is served first): the policy version its trajectory started
    with, i.e. its deadline start_version + eta less the common eta."""
    return int(start_version)


def edf_insert(queue: deque, item: Any, key: int, key_of) -> None:
    """Insert `item` (priority `key`) into `queue`, kept ordered by `key_of(element)`, after every element of
    the same or a lower key (FIFO among equals). The common case, a request of the newest version, appends;
    an older one walks back only past the newer requests queued."""
    if not queue or key_of(queue[-1]) <= key:
        queue.append(item)
        return
    i = len(queue) - 1
    while i > 0 and key_of(queue[i - 1]) > key:
        i -= 1
    queue.insert(i, item)


def select_batch(tasks: Iterable[tuple[T, int, bool]], version: int, eta: int | None,
                 count: int) -> tuple[list[T] | None, str]:
    """The trainer's batch for step `version` (the step that turns policy version `version` into version + 1).

    `tasks` are the started groups not yet trained in start order (oldest first), each (item, start version,
    finished).
    eta None: AReaL's rule, the first `count` finished groups (its admission bound alone limits the lag).
    eta set (Libra's bounded lag): every group that started at version <= version - eta would be trained
    more than eta versions after it started if it missed this step, so it must be in this batch: wait while
    one of them is still running (the only wait the bound adds), take them all (the batch grows past
    `count` in the rare case that there are more), and fill the rest with the oldest finished groups.
    Returns (the batch, "") or (None, why the trainer waits: "stale" or "count"). One rule for the
    simulator (sim/cluster.py) and the live executor (patch 14, installed by areal_libra.live.train)."""
    need_before = version - eta if eta is not None else None
    forced: list[T] = []
    rest: list[T] = []
    for item, start, done in tasks:
        if need_before is not None and start <= need_before:
            if not done:
                return None, "stale"
            forced.append(item)
        elif len(rest) >= count:
            break  # tasks come in start order: no forced group follows a younger one
        elif done:
            rest.append(item)
    batch = forced + rest[: max(0, count - len(forced))]
    if len(batch) < count:
        return None, "count"
    return batch, ""
