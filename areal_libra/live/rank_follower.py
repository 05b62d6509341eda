"""The rollout layout on trainer ranks other than 0 (a multi-rank trainer, e.g. cluster=ray_local's fsdp:d2).

In AReaL's SPMD mode every data-parallel rank is the head of its own group and runs its own rollout engine
and request router; the fleet (rollout/fleet.py, the one owner of rollout membership) lives on rank 0 only.
When the fleet replaces a dead server or switches layouts, it rewrites <run_dir>/rollout_groups.json; this
follower reads that file and switches the rank's router groups and engine addresses together, as the fleet
does on rank 0 (without it the rank's requests wait for servers that no longer exist). The new servers already
serve the current weights when the file changes (the fleet checks their version before its own switch).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from areal_libra.rollout.router import GROUPS_FILE, read_groups_file
from areal_libra.utils import atomic_write_text, first_line

log = logging.getLogger(__name__)


class LayoutFollower:
    """A daemon thread applying rank 0's rollout layout (rollout_groups.json) to this rank's router."""

    def __init__(self, engine: Any, router: Any, run_dir: str | Path, interval_s: float = 1.0) -> None:
        self._inner = getattr(engine, "_engine", engine)  # RemoteInfEngine: addresses, lock
        self.router = router
        self.path = Path(run_dir) / GROUPS_FILE
        self.interval_s = interval_s
        self.applied = 0  # layout changes applied
        self._last = self._read_text()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read_text(self) -> str:
        try:
            return self.path.read_text()
        except OSError:
            return ""

    def check_once(self) -> bool:
        """Apply the file's layout if it changed since the last one; whether it was applied."""
        text = self._read_text()
        if not text or text == self._last:
            return False
        try:
            groups, addrs = read_groups_file(self.path)
        except ValueError as e:  # half-written files cannot happen (atomic writes); a bad one is skipped
            log.warning("rank follower: %s", first_line(e))
            return False
        with self._inner.lock:
            self.router.set_layout(groups, addrs)
            self._inner.addresses = [a for row in addrs for a in row]
        self._last = text
        self.applied += 1
        log.warning("rank follower: rollout layout now %s", [len(r) for r in addrs])
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check_once()
            except Exception as e:  # noqa: BLE001 - the thread must outlive one bad round
                log.warning("rank follower: round failed: %s", first_line(e))

    def write_counters(self, counters: dict[str, float]) -> None:
        """This rank's AReaL rollout counters at the end (rank 0's are in metrics.jsonl):
        rollout_counters.rank<R>.json, so a run can show that no rank lost or rejected a rollout."""
        rank = os.environ.get("RANK", "0")
        atomic_write_text(self.path.parent / f"rollout_counters.rank{rank}.json", json.dumps(counters) + "\n")

    def start(self) -> LayoutFollower:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rollout-follow", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
