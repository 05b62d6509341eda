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

    def wait(self, k: str, timeout_s: float, poll_s: float = 2.0, abort: Any = None) -> Any:
        """Block until `k` exists (server-side wait: no polling, wakes as soon as it is set).

        TimeoutError after timeout_s; `abort()` is checked every poll_s and returning True gives None.
        (Each slice that runs out makes c10d log a warning, so slices are long and protocols avoid them.)
        """
        deadline = time.monotonic() + timeout_s
        key = self.key(k)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"store key {key} not set within {timeout_s:.1f}s")
            try:
                self.store.wait([key], datetime.timedelta(seconds=min(poll_s, left)))
                return json.loads(self.store.get(key))
            except dist.DistStoreError:
                pass  # timed out this slice
            if abort is not None and abort():
                return None

    def get_many(self, ks: list[str]) -> dict[str, Any]:
        """Values of the keys that exist; two round trips when all exist (the common case)."""
        if not ks:
            return {}
        full = [self.key(k) for k in ks]
        if self.store.check(full):
            return {k: json.loads(v) for k, v in zip(ks, self.store.multi_get(full))}
        return {k: v for k in ks if (v := self.get(k)) is not None}

    def add(self, k: str, n: int = 1) -> int:
        return int(self.store.add(self.key(k), n))
