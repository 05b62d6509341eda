"""Server health for the live router: a probe thread that marks rollout servers down and up again.

Failures are counted per server: `fail_after` consecutive failed probes (GET /health with a timeout)
mark a server down; `ok_after` consecutive good probes bring it back, but only if `may_readmit(addr)`
agrees (the router refuses a server that missed a weight update while it was out). Callers can also
report a failure directly (a request that could not reach the server); the probe then re-admits it.
Every transition is an event (time, address, up/down, reason) kept for the step metrics.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class HealthEvent:
    t: float
    addr: str
    up: bool
    reason: str


def probe(addr: str, timeout_s: float) -> bool:
    """True if GET http://addr/health answers 200 within timeout_s."""
    try:
        with urllib.request.urlopen(f"http://{addr}/health", timeout=timeout_s) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


class HealthMonitor:
    def __init__(
        self,
        addresses: Iterable[str],
        on_change: Callable[[str, bool, str], None],
        interval_s: float = 2.0,
        timeout_s: float = 5.0,
        fail_after: int = 2,
        ok_after: int = 2,
        may_readmit: Callable[[str], bool] | None = None,
        probe_fn: Callable[[str, float], bool] = probe,
    ) -> None:
        self.addresses = list(addresses)
        self.on_change = on_change
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.fail_after, self.ok_after = max(1, fail_after), max(1, ok_after)
        self.may_readmit = may_readmit
        self.probe_fn = probe_fn
        self._lock = threading.Lock()
        self._down: dict[str, str] = {}
        self._fails = dict.fromkeys(self.addresses, 0)
        self._oks = dict.fromkeys(self.addresses, 0)
        self.events: list[HealthEvent] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- state ---
    def is_down(self, addr: str) -> bool:
        return addr in self._down  # dict membership is atomic; no lock on the request path

    def down(self) -> set[str]:
        with self._lock:
            return set(self._down)

    def _set(self, addr: str, up: bool, reason: str) -> None:
        with self._lock:
            if up == (addr not in self._down):
                return
            if up:
                del self._down[addr]
            else:
                self._down[addr] = reason
            self.events.append(HealthEvent(time.time(), addr, up, reason))
        self.on_change(addr, up, reason)

    def report_failure(self, addr: str, reason: str) -> None:
        """A request could not be served by addr: take it out now (the probe re-admits it)."""
        with self._lock:
            self._oks[addr] = 0
        self._set(addr, False, reason)

    def add(self, addr: str) -> None:
        with self._lock:
            if addr not in self.addresses:
                self.addresses = [*self.addresses, addr]  # a new list: the probe loop iterates the old one
            self._fails[addr] = self._oks[addr] = 0
            self._down.pop(addr, None)

    def remove(self, addr: str) -> None:
        with self._lock:
            self.addresses = [a for a in self.addresses if a != addr]
            self._down.pop(addr, None)

    def set_addresses(self, addresses: Iterable[str]) -> None:
        """Probe these servers from now on (a reconfiguration added or removed some)."""
        keep = list(dict.fromkeys(addresses))
        with self._lock:
            self.addresses = keep  # a new list: a probe round in progress finishes on the old one
            for d in (self._fails, self._oks):
                for a in [a for a in d if a not in keep]:
                    del d[a]
                for a in keep:
                    d.setdefault(a, 0)
            for a in [a for a in self._down if a not in keep]:
                del self._down[a]

    # --- probing ---
    def check_once(self) -> None:
        for addr in self.addresses:
            ok = self.probe_fn(addr, self.timeout_s)
            with self._lock:
                if addr not in self._fails:  # removed by set_addresses meanwhile
                    continue
                if ok:
                    self._fails[addr] = 0
                    self._oks[addr] = self._oks.get(addr, 0) + 1
                    ready = addr in self._down and self._oks[addr] >= self.ok_after
                    fail = False
                else:
                    self._oks[addr] = 0
                    self._fails[addr] = self._fails.get(addr, 0) + 1
                    fail = addr not in self._down and self._fails[addr] >= self.fail_after
                    ready = False
            if fail:
                self._set(addr, False, f"{self.fail_after} failed health probes")
            elif ready and (self.may_readmit is None or self.may_readmit(addr)):
                self._set(addr, True, "healthy again")

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.check_once()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rollout-health", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s + self.interval_s + 1)
            self._thread = None
