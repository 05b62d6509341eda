"""The live run's one rollout-pressure sampler: the serving servers' own counts (`/server_info`), sampled
in the background and reduced by the shared definition in `areal_libra.elastic.measure` (the simulator
applies the same `pressure` to its own servers).
"""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Callable, Collection
from typing import Any

from areal_libra.elastic.measure import Pressure, ServerLoad, mean_pressure, pressure


def server_load(info: dict[str, Any]) -> ServerLoad:
    """A server's counts from its /server_info. The KV term needs both the tokens in use (`num_used_tokens`)
    and the capacity (`max_total_num_tokens`); a server that reports only one counts by request slots."""
    kv_used = info.get("num_used_tokens")
    kv_cap = int(info.get("max_total_num_tokens", 0) or 0) if kv_used is not None else 0
    return ServerLoad(running=int(info.get("num_running_requests", 0)),
                      waiting=int(info.get("num_waiting_requests", 0)),
                      max_running=int(info.get("max_running_requests", 0) or 0),
                      kv_used=int(kv_used or 0), kv_capacity=kv_cap)


class PressureSampler:
    """Samples the serving rollout servers (`addresses()`) every `interval_s` in the background; `take()`
    gives the window's mean Pressure (queue, active) and starts the next window. One per run: the elastic
    pool's measurement and the controller read the same windows."""

    def __init__(self, addresses: Callable[[], list[str]], interval_s: float = 1.0, timeout_s: float = 1.0,
                 lent: Callable[[], Collection[str]] | None = None) -> None:
        """`lent`: the addresses among them that the elastic pool may take back (its hybrids' servers): sampled
        for pressure, left out of kv_capacity (cmlfq.aging.admit_group)."""
        self.addresses, self.interval_s, self.timeout_s = addresses, interval_s, timeout_s
        self.lent = lent
        self._samples: list[Pressure] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.errors = 0
        self._kv_capacity = 0  # the last sample's KV capacity over the servers that answered (0: unknown)
        self._waiting = 0  # the last sample's queued requests over the servers that answered
        self._thread = threading.Thread(target=self._run, name="rollout-pressure", daemon=True)
        self._thread.start()

    def sample(self) -> Pressure | None:
        """The pressure now, over the servers that answered; None if none did."""
        loads, staying = [], 0
        lent = set(self.lent()) if self.lent is not None else set()
        for addr in self.addresses():
            try:
                with urllib.request.urlopen(f"http://{addr}/server_info", timeout=self.timeout_s) as r:
                    load = server_load(json.loads(r.read()))
            except (OSError, ValueError):
                self.errors += 1
                continue
            loads.append(load)
            if addr not in lent:
                staying += load.kv_capacity
        if loads:
            self._kv_capacity, self._waiting = staying, sum(load.waiting for load in loads)
        return pressure(loads) if loads else None

    def waiting(self) -> int:
        """Requests queued on the servers at the last sample that reached any (0 before one)."""
        return self._waiting

    def kv_capacity(self) -> int:
        """KV tokens of the serving servers that stay (not `lent`) at the last sample that reached any (0: none
        reports it yet)."""
        return self._kv_capacity

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            s = self.sample()
            if s is not None:
                with self._lock:
                    self._samples.append(s)

    def take(self) -> Pressure:
        with self._lock:
            samples, self._samples = self._samples, []
        return mean_pressure(samples)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self.interval_s + self.timeout_s * 4 + 1)
