"""The trajectory sink shared by every workflow: finished episodes go to the live prefix tree and trace writer.

A workflow module re-exports `set_trajectory_sink` (live/train.py and the router look it up on the
workflow's module) and calls `emit` once per finished episode."""

from __future__ import annotations

import logging
from collections.abc import Callable

from areal_libra.trace import Trajectory

logger = logging.getLogger("areal_libra.sink")

_trajectory_sink: Callable[[Trajectory], None] | None = None


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
