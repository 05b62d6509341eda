"""The trajectory sink shared by every workflow: finished episodes go to the live prefix tree and trace writer.

A workflow module re-exports `set_trajectory_sink` (live/train.py and the router look it up on the
workflow's module) and calls `emit` once per finished episode, inside `running(version)` (the policy version the
episode started at), so the live controller knows the oldest start version still in flight (`oldest_running`:
control.cohorts, the complete-cohort history)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from areal_libra.trace import Trajectory

logger = logging.getLogger("areal_libra.sink")

_trajectory_sink: Callable[[Trajectory], None] | None = None
# Episodes in flight per start version: written by the rollout thread, read by the trainer's control hook.
_running: dict[int, int] = {}
_running_lock = threading.Lock()


def set_trajectory_sink(sink: Callable[[Trajectory], None] | None) -> None:
    """Receive every finished episode as a Trajectory (None: stop). Called from the rollout thread."""
    global _trajectory_sink
    _trajectory_sink = sink


def emit(traj: Trajectory) -> None:
    sink = _trajectory_sink
    if sink is None:
        return
    try:
        sink(traj)
    except Exception:  # noqa: BLE001 - a broken observer must not lose the training sample
        logger.exception("trajectory sink failed for %s", traj.trajectory_id)


@contextmanager
def running(version: int) -> Iterator[None]:
    """An episode that started at policy `version` is in flight for the block (left however it ends: finished,
    failed or cancelled by a weight update's abort)."""
    v = int(version)
    with _running_lock:
        _running[v] = _running.get(v, 0) + 1
    try:
        yield
    finally:
        with _running_lock:
            left = _running.get(v, 0) - 1
            if left > 0:
                _running[v] = left
            else:
                _running.pop(v, None)


def oldest_running() -> int | None:
    """The oldest start version among the episodes in flight (None: none is)."""
    with _running_lock:
        return min(_running) if _running else None
