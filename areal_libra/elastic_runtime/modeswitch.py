"""Mode switch: the rollout side of a hybrid replica (start a server with current weights, drain it).

Two implementations of `hybrid.RolloutSide`:
- `QueueRollout`: a rollout worker over a shared store queue (the test bed's rollout workload). Its
  in-flight requests are handed back to the queue on drain, so another server finishes them: none lost.
- `HttpRollout`: an SGLang-API server (real SGLang on GPU, the embedded server on CPU) driven through a
  caller-supplied launcher and the dispatcher's register/unregister hooks; drain = unregister, then
  `/pause_generation` (abort), which returns running requests to AReaL's client with finish reason
  abort, and the client re-sends them (prompt + tokens so far) to a server the dispatcher picks.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import torch

from areal_libra.elastic_runtime.kv import KV, connect


class QueueRollout:
    """Claims request ids from `rollout/next` (or from handed-back ids first), "generates" with the
    replica's model, marks `rollout/done/<id>` with the weight fingerprint it used."""

    def __init__(self, host: str, port: int, namespace: str, name: str, service_s: float = 0.02) -> None:
        self.host, self.port, self.ns, self.name = host, port, namespace, name
        self.service_s = service_s
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.in_flight: set[int] = set()
        self.served = 0

    def start(self, replica: Any) -> None:
        params = [p.detach().clone() for p in getattr(replica, "params", [])]
        fingerprint = float(sum(p.double().sum() for p in params)) if params else 0.0
        self._stop.clear()
        self._thread = threading.Thread(target=self._serve, args=(fingerprint,), daemon=True)
        self._thread.start()

    def _claim(self, kv: KV) -> int | None:
        """Take the next ticket. Tickets are request ids; handed-back requests get new tickets at the end.
        The cursor moves past a ticket only after it is claimed, so no ticket is skipped or taken twice."""
        store = kv.store
        cur_key, tot_key = kv.key("rollout/cursor"), kv.key("rollout/total")
        while True:
            cur = int(store.add(cur_key, 0))
            if cur >= int(store.add(tot_key, 0)):
                return None
            mine = kv.add(f"rollout/claimed/{cur}", 1) == 1  # exactly one claimer per ticket
            store.compare_set(cur_key, str(cur), str(cur + 1))  # move past a claimed ticket (anyone may)
            if mine:
                return int(kv.wait(f"rollout/ticket/{cur}", 10.0))

    def _serve(self, fingerprint: float) -> None:
        kv = KV(connect(self.host, self.port), self.ns)
        while not self._stop.is_set():
            with self._lock:
                req = self._claim(kv)
                if req is not None:
                    self.in_flight.add(req)
            if req is None:
                self._stop.wait(0.01)
                continue
            with torch.no_grad():
                _ = torch.randn(8, 8) @ torch.randn(8, 8)  # stand-in for decoding work
            if self._stop.wait(self.service_s):
                return  # drained mid-request: drain() hands it back
            with self._lock:
                if req in self.in_flight:
                    self.in_flight.discard(req)
                    kv.set(f"rollout/done/{req}", {"by": self.name, "weights": fingerprint})
                    kv.add(f"rollout/done_n/{req}", 1)  # >1 would mean a request was served twice
                    self.served += 1

    def drain(self) -> list[int]:
        with self._lock:
            self._stop.set()
            handed = sorted(self.in_flight)
            self.in_flight.clear()
        if self._thread is not None:
            self._thread.join(5.0)
        kv = KV(connect(self.host, self.port), self.ns)
        for req in handed:
            push_requests(kv, [req])
        return handed


def push_requests(kv: KV, reqs: list[int]) -> None:
    """Append tickets: allocate slots, write them, then publish by raising `total` (readers wait for
    a published slot whose write is still in flight)."""
    for req in reqs:
        idx = kv.add("rollout/alloc", 1) - 1
        kv.set(f"rollout/ticket/{idx}", req)
        kv.add("rollout/total", 1)


def _post(url: str, body: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        text = r.read().decode() or "{}"
    try:
        return json.loads(text)
    except ValueError:
        return {"text": text}


class HttpRollout:
    """A SGLang-API rollout server on the hybrid replica's devices."""

    def __init__(
        self,
        launch: Callable[[Any], tuple[str, Callable[[], None]]],
        register: Callable[[str], None],
        unregister: Callable[[str], None],
        ready_timeout_s: float = 300.0,
    ) -> None:
        # launch(replica) -> (base_url, stop): start a server with the replica's current weights
        # (e.g. save an HF checkpoint and start SGLang / the embedded server on it).
        self.launch, self.register, self.unregister = launch, register, unregister
        self.ready_timeout_s = ready_timeout_s
        self.url: str | None = None
        self._stop_fn: Callable[[], None] | None = None

    def start(self, replica: Any) -> None:
        self.url, self._stop_fn = self.launch(replica)
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"rollout server {self.url} not healthy within {self.ready_timeout_s}s")
            time.sleep(0.2)
        self.register(self.url)

    def _settle(self, url: str, quiet_s: float = 0.3, limit_s: float = 10.0) -> None:
        """A request routed here just before the unregistration can still arrive after the pause (a paused
        server would hold it until stopped, and its client would time out): abort whatever arrives until
        the server has been empty for `quiet_s`."""
        deadline = time.monotonic() + limit_s
        quiet_since = time.monotonic()
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url + "/get_server_info", timeout=5) as r:
                    info = json.loads(r.read())
                busy = int(info.get("num_running_requests", 0)) + int(info.get("num_waiting_requests", 0))
            except (OSError, ValueError):
                return  # gone, or no counts to read (then the pause's abort is all we can do)
            if busy:
                _post(url + "/abort_request", {"abort_all": True})
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= quiet_s:
                return
            time.sleep(0.05)

    def drain(self) -> list[str]:
        if self.url is None:
            return []
        url = self.url
        self.unregister(url)  # no new requests are routed here
        # Running requests come back with finish reason "abort"; AReaL's client re-sends them elsewhere.
        _post(url + "/pause_generation", {"mode": "abort"})
        self._settle(url)
        if self._stop_fn is not None:
            self._stop_fn()
        self.url = None
        return [url]
