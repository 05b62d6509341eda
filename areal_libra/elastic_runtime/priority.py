"""Where the elastic runtime's background work runs: low priority, optionally on CPUs away from training.

Snapshot writes, the gradient log, a joiner's fetch/verify/replay must yield to the training step they
run beside (the "non-blocking join"). Linux applies nice values and CPU affinity per thread, so a
background thread lowers only itself: `os.setpriority(PRIO_PROCESS, native thread id, nice)` and
`os.sched_setaffinity(native thread id, cpus)`. An unprivileged thread cannot raise its priority again,
which is why low-priority work lives on threads of its own and never on a training thread.

The placement is a per-process decision of whoever starts the process (the test bed, a launcher):
`configure(nice=..., cpus=...)` once; every background thread calls `enter_background()` first.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class BackgroundPlacement:
    # 0 = same priority as training; 19 = only otherwise idle CPU time, which starves a join for as long
    # as other processes keep the CPUs busy; 10 (~10% of a CPU shared with a nice-0 thread) still progresses.
    nice: int = 10
    cpus: frozenset[int] | None = None  # None: wherever the OS puts it


_placement = BackgroundPlacement()


def configure(nice: int | None = None, cpus: set[int] | frozenset[int] | None = None) -> BackgroundPlacement:
    """Set this process's placement of background threads (threads started afterwards)."""
    global _placement
    _placement = BackgroundPlacement(
        nice=_placement.nice if nice is None else int(nice),
        cpus=_placement.cpus if cpus is None else frozenset(cpus),
    )
    return _placement


def placement() -> BackgroundPlacement:
    return _placement


def set_placement(p: BackgroundPlacement) -> None:
    global _placement
    _placement = p


def place_thread(cpus: frozenset[int] | None) -> None:
    """Pin the calling thread (only it) to `cpus`; a no-op where unsupported or when cpus is None/empty."""
    if cpus and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(threading.get_native_id(), cpus)
        except OSError:
            pass  # CPUs not available to this process (cgroup): stay where we are


def lower_thread_priority(nice: int) -> None:
    """Raise the calling thread's nice value to `nice` (never lowers it)."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    tid = threading.get_native_id()
    try:
        cur = os.getpriority(os.PRIO_PROCESS, tid)
        if nice > cur:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError:
        pass


def enter_background(lower: bool = True) -> None:
    """Called first thing on a background thread. lower=False keeps normal priority (work that the
    training step will wait for, e.g. a snapshot clone behind a fence) but still moves it off the
    training CPUs."""
    p = _placement
    place_thread(p.cpus)
    if lower:
        lower_thread_priority(p.nice)
