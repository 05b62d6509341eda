"""Tools behind persistent worker processes (WorkerProcess / WorkerPool), and the sandboxed calculator:
arithmetic runs in a separate, persistent worker process with a timeout.

Errors and timeouts are tool outcomes (status 'failure' / 'timeout' with an error text as payload), never
exceptions. A worker that exceeds the timeout or dies is killed and respawned on the next call. A call
costs one pipe round trip (tens of microseconds), so hundreds of calls per training step are cheap."""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import queue
import selectors
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

WORKER_SCRIPT = Path(__file__).with_name("_calc_worker.py")
MAX_PAYLOAD_CHARS = 64


@dataclass(frozen=True)
class ToolResult:
    status: str  # "success" | "failure" | "timeout" (trace.TOOL_STATUSES)
    payload: str  # text appended to the context between <result> tags
    latency_s: float


def _clip(text: str) -> str:
    return text if len(text) <= MAX_PAYLOAD_CHARS else text[: MAX_PAYLOAD_CHARS - 3] + "..."


class WorkerProcess:
    """One persistent stdlib worker process (`python -I -S SCRIPT`) speaking one JSON object per line each
    way; calls are serialised by a lock. A call that gets no reply within the timeout, or whose worker
    dies, kills the worker (it is respawned on the next call). Subclasses turn replies into ToolResults."""

    name = "worker"
    script: Path = WORKER_SCRIPT

    def __init__(self, timeout_s: float = 1.0):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._proc: subprocess.Popen | None = None
        self._buf = b""
        self._lock = threading.Lock()
        self.respawns = 0

    def _start(self) -> subprocess.Popen:
        # -I -S: no site-packages, no user env — the worker needs only the standard library.
        # close_fds=False lets subprocess use posix_spawn: with fork+exec, the parent waits on an error
        # pipe until exec, and a process forked meanwhile by another thread (AReaL's reward process pool)
        # inherits that pipe and holds the parent forever (seen as a hang in the rollout thread). Python's
        # own descriptors are close-on-exec, so nothing leaks into the worker.
        self._proc = subprocess.Popen(
            [sys.executable, "-I", "-S", str(self.script), *self._worker_args()],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0,
            close_fds=False,
        )
        self._buf = b""
        return self._proc

    def _worker_args(self) -> list[str]:
        return []

    def _cleanup(self) -> None:
        """After the worker is gone: remove what it may have left (subclasses)."""

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None
            self.respawns += 1
            self._cleanup()

    def start(self) -> None:
        """Start the worker now (it is otherwise started by the first call)."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                self._proc.kill()
                self._proc.wait()
                self._proc = None
                self._cleanup()

    def _read_line(self, proc: subprocess.Popen, deadline: float) -> bytes | None:
        fd = proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    return None
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise EOFError(f"{self.name} worker exited")
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def request(self, obj: dict) -> tuple[dict | None, ToolResult | None]:
        """(the worker's reply, None), or (None, the failure / timeout outcome) when there is no reply."""
        t0 = time.monotonic()
        with self._lock:
            proc = self._proc if self._proc is not None and self._proc.poll() is None else self._start()
            try:
                proc.stdin.write((json.dumps(obj) + "\n").encode())
                line = self._read_line(proc, t0 + self.timeout_s)
            except (OSError, EOFError) as e:
                self._kill()
                return None, ToolResult("failure", _clip(f"WorkerError: {e}"), time.monotonic() - t0)
            if line is None:
                self._kill()
                return None, ToolResult("timeout", f"TimeoutError: no result within {self.timeout_s:g} s",
                                        time.monotonic() - t0)
        return json.loads(line), None


class CalculatorTool(WorkerProcess):
    """The calculator: one persistent worker evaluating arithmetic."""

    name = "calculator"

    def call(self, expr: str) -> ToolResult:
        t0 = time.monotonic()
        reply, outcome = self.request({"expr": expr})
        if reply is None:
            return outcome
        if reply.get("ok"):
            return ToolResult("success", _clip(reply["value"]), time.monotonic() - t0)
        return ToolResult("failure", _clip(reply["error"]), time.monotonic() - t0)


class WorkerPool:
    """A few workers so that one slow call does not hold up the other episodes' tool calls."""

    worker_cls: type = CalculatorTool

    def __init__(self, size: int = 2, timeout_s: float = 1.0):
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.name = self.worker_cls.name
        self.timeout_s = timeout_s
        self._tools = [self.worker_cls(timeout_s) for _ in range(size)]
        self._free: queue.Queue = queue.Queue()
        for t in self._tools:
            self._free.put(t)

    def call(self, *args, **kwargs):
        tool = self._free.get()
        try:
            return tool.call(*args, **kwargs)
        finally:
            self._free.put(tool)

    def start(self) -> None:
        for t in self._tools:
            t.start()

    async def acall(self, *args, **kwargs):
        return await asyncio.to_thread(self.call, *args, **kwargs)

    @property
    def respawns(self) -> int:
        return sum(t.respawns for t in self._tools)

    def close(self) -> None:
        for t in self._tools:
            t.close()


class CalculatorPool(WorkerPool):
    worker_cls = CalculatorTool


_POOLS: dict[tuple[type, int, float], WorkerPool] = {}
_POOLS_LOCK = threading.Lock()


def get_pool(cls: type[WorkerPool], size: int = 2, timeout_s: float = 1.0) -> WorkerPool:
    """The process-wide pool of `cls` for these settings (workflows are created per rollout worker process)."""
    with _POOLS_LOCK:
        key = (cls, size, float(timeout_s))
        if key not in _POOLS:
            _POOLS[key] = cls(size, timeout_s)
        return _POOLS[key]


def get_calculator_pool(size: int = 2, timeout_s: float = 1.0) -> CalculatorPool:
    return get_pool(CalculatorPool, size, timeout_s)


@atexit.register
def _close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()


def calculator_payload(expr: str) -> str:
    """The payload text the tool returns for `expr` (an error text on failure or timeout)."""
    return get_calculator_pool(size=1).call(expr).payload
