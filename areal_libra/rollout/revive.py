"""Replace rollout servers that died, inside the trainer (rank 0, libra mode, where the fleet lives).

A server that dies (SIGKILL, OOM) is marked down by the router's health probe; its in-flight requests wait
in the router's failover path (up to scheduler.failover_wait_s) for a healthy server. Without a
replacement a run with one server would stall there and fail. The reviver polls for servers of the fleet
that are down or whose process is gone and asks the fleet for the same layout again: the fleet keeps the
healthy servers, starts a new one with the current weights (the last disk weight update) and switches the
router to it, so the waiting requests resume there with their tokens so far.

A replacement that fails for a passing reason (a weight update in progress: FleetError.transient) is retried
every round. One that fails for any other reason (the server cannot start, the weight-update group cannot be
formed) is tried `max_tries` times in a row; then the reviver gives up, says so once (the log and one
revive.jsonl line with the reason) and tries again only once the fleet's layout has changed (a re-plan
succeeded) - not the same error forever.

Every replacement is one line in <run_dir>/revive.jsonl; `rollout_counters` adds AReaL's own rollout
counters (submitted, accepted, rejected) to the step metrics so a run can show that nothing was lost.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from pathlib import Path
from typing import Any

from areal_libra.rollout.fleet import FleetError
from areal_libra.utils import append_jsonl, first_line

log = logging.getLogger(__name__)

REVIVE_LOG = "revive.jsonl"


class ServerReviver:
    """A daemon thread that replaces dead rollout servers through `fleet.reconfigure(None)` (the layout in force)."""

    def __init__(self, fleet: Any, router: Any, run_dir: str | Path | None = None, interval_s: float = 1.0,
                 max_tries: int = 3) -> None:
        if max_tries < 1:
            raise ValueError(f"max_tries must be >= 1, got {max_tries}")
        self.fleet = fleet
        self.router = router
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.interval_s = interval_s
        self.max_tries = max_tries
        self.revived = 0  # servers replaced
        self.failures = 0  # replacement attempts that failed
        self.strikes = 0  # non-transient failures in a row
        self.gave_up: str | None = None  # the reason, once max_tries non-transient failures in a row
        self._gave_up_at: int | None = None  # fleet.reconfigurations then: a later layout change retries
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def dead(self) -> list[str]:
        """Addresses of fleet servers that are marked down or whose process is gone."""
        down = self.router.down_addresses()
        return [s.addr for s in list(self.fleet.servers) if s.addr in down or not s.alive()]

    def check_once(self) -> dict | None:
        """Replace what is dead now; the fleet's result, or None when nothing was dead or it failed."""
        dead = self.dead()
        if not dead:
            return None
        if self.gave_up is not None:
            if getattr(self.fleet, "reconfigurations", None) == self._gave_up_at:
                return None  # said once; the same layout would fail the same way
            self.gave_up, self.strikes = None, 0  # the layout changed since: try again

        t0 = time.monotonic()
        try:
            out = self.fleet.reconfigure(None, step=-1)  # not fleet.groups now: a re-plan may be under way
        except FleetError as e:
            self.failures += 1
            if getattr(e, "transient", False):  # e.g. a weight update in progress: the next round retries
                log.warning("revive: cannot replace %s yet: %s", dead, first_line(e))
                return None
            self.strikes += 1
            if self.strikes < self.max_tries:
                log.warning("revive: replacing %s failed (try %d of %d): %s", dead, self.strikes, self.max_tries,
                            first_line(e))
                return None
            self._give_up(dead, first_line(e))
            return None
        self.strikes = 0
        if not out.get("started"):
            return None  # a reconfiguration under way had stopped them, or (xccl) they join at the next update
        self.revived += len(out.get("started", []))
        rec = {"t": round(time.time(), 3), "dead": dead, "started": out.get("started", []),
               "stopped": out.get("stopped", []), "revive_s": round(time.monotonic() - t0, 3)}
        log.warning("revive: replaced %s by %s in %.1fs", dead, rec["started"], rec["revive_s"])
        if self.run_dir is not None:
            with contextlib.suppress(OSError):
                append_jsonl(self.run_dir / REVIVE_LOG, rec)
        return rec

    def _give_up(self, dead: list[str], reason: str) -> None:
        self.gave_up = reason
        self._gave_up_at = getattr(self.fleet, "reconfigurations", None)
        log.error("revive: giving up on %s after %d failed tries (%s); the servers left keep serving, and "
                  "no replacement is tried again until the layout changes", dead, self.strikes, reason)
        if self.run_dir is not None:
            with contextlib.suppress(OSError):
                append_jsonl(self.run_dir / REVIVE_LOG, {"t": round(time.time(), 3), "dead": dead,
                                                         "gave_up": reason, "tries": self.strikes})

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check_once()
            except Exception as e:  # noqa: BLE001 - the thread must outlive one bad round
                self.failures += 1
                log.warning("revive: round failed: %s", first_line(e))

    def start(self) -> ServerReviver:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rollout-revive", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def metrics(self) -> dict[str, float]:
        return {"revive/servers_replaced": self.revived, "revive/failed_attempts": self.failures,
                "revive/gave_up": float(self.gave_up is not None)}


def rollout_counters(engine: Any) -> dict[str, float]:
    """AReaL's cumulative rollout counters (one rollout = one prompt's group): accepted and rejected
    (a workflow that raised or returned nothing) since the start, and those running or queued now."""
    inner = getattr(engine, "_engine", engine)
    try:
        st = inner.workflow_executor.staleness_manager.get_stats()
    except Exception:  # noqa: BLE001 - no executor yet (before the first rollout)
        return {}
    return {"rollout/accepted_total": st.accepted, "rollout/rejected_total": st.rejected,
            "rollout/running": st.running, "rollout/enqueued": st.enqueued}
