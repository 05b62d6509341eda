"""Small JSON helpers over a torch.distributed Store (TCPStore on loopback or across nodes)."""

from __future__ import annotations

import datetime
import json
import time
from typing import Any

import torch.distributed as dist


def connect(host: str, port: int, timeout_s: float = 30.0) -> dist.TCPStore:
    """A client connection; every thread that talks to the store concurrently gets its own."""
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


class KV:
    def __init__(self, store: dist.Store, namespace: str) -> None:
        self.store = store
        self.ns = namespace.rstrip("/") + "/"

    def key(self, k: str) -> str:
        return self.ns + k

    def set(self, k: str, value: Any) -> None:
        self.store.set(self.key(k), json.dumps(value))

    def has(self, k: str) -> bool:
        return bool(self.store.check([self.key(k)]))

    def get(self, k: str, default: Any = None) -> Any:
        """Non-blocking: `default` when the key does not exist."""
        if not self.has(k):
            return default
        return json.loads(self.store.get(self.key(k)))

    def wait(self, k: str, timeout_s: float, poll_s: float = 0.002, abort: Any = None) -> Any:
        """Poll until `k` exists; TimeoutError after timeout_s; `abort()` returning True stops early (None)."""
        deadline = time.monotonic() + timeout_s
        sleep = poll_s
        while True:
            if self.has(k):
                return json.loads(self.store.get(self.key(k)))
            if abort is not None and abort():
                return None
            if time.monotonic() > deadline:
                raise TimeoutError(f"store key {self.key(k)} not set within {timeout_s:.1f}s")
            time.sleep(sleep)
            sleep = min(sleep * 1.5, 0.02)  # short polls first: the key usually arrives within a millisecond

    def add(self, k: str, n: int = 1) -> int:
        return int(self.store.add(self.key(k), n))
