"""The code sandbox tool: model-written Python runs against tests in a child of a persistent worker process
(_code_worker.py: a fresh child per call, own session, temp cwd, rlimits, `nobody` when root, an audit hook
refusing processes/sockets/imports/file access outside the temp dir, a wall-clock kill). The process
management is tools.py's (WorkerProcess / WorkerPool); errors and timeouts are outcomes, never exceptions."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_libra.workflows.code_markup import run_payload
from areal_libra.workflows.tools import WorkerPool, WorkerProcess, get_pool

Tests = list[tuple[list[Any], Any]]

CODE_WORKER_SCRIPT = Path(__file__).with_name("_code_worker.py")
MAX_CODE_CHARS = 4096
# The worker answers within the run's own limit; this margin covers forking and reaping the child.
BACKSTOP_MARGIN_S = 3.0


@dataclass(frozen=True)
class ExecResult:
    status: str  # "success" | "failure" | "timeout" (trace.TOOL_STATUSES)
    passed: tuple[bool, ...]  # per test: returned exactly the expected value
    outputs: tuple[str, ...]  # per test that ran: the returned value as JSON text, or the exception's name
    error: str | None  # why the run failed (exception name, "Timeout after 1 s", "Killed by signal 9", ...)
    latency_s: float

    @property
    def fraction(self) -> float:
        return sum(self.passed) / len(self.passed) if self.passed else 0.0


class CodeExecTool(WorkerProcess):
    """One worker; `timeout_s` is each run's wall-clock limit (the worker kills the child at it)."""

    name = "python"
    script = CODE_WORKER_SCRIPT

    def __init__(self, timeout_s: float = 1.0, mem_mb: int = 256):
        super().__init__(timeout_s + BACKSTOP_MARGIN_S)
        self.run_timeout_s = timeout_s
        self.mem_mb = mem_mb
        self.base_dir: str | None = None

    def _worker_args(self) -> list[str]:
        # Each run's temp dir lives under this one, removed here even when the worker was killed.
        self._cleanup()
        self.base_dir = tempfile.mkdtemp(prefix="code-sandbox-")
        os.chmod(self.base_dir, 0o711)  # the run's child may be `nobody`: it must reach its own dir
        return [self.base_dir]

    def _cleanup(self) -> None:
        if self.base_dir is not None:
            shutil.rmtree(self.base_dir, ignore_errors=True)
            self.base_dir = None

    def call(self, code: str, tests: list[tuple[list[Any], Any]], fn: str = "f") -> ExecResult:
        """Define `fn` by running `code`, then call it on each test's args; a test passes when it returns a
        value equal to, and of the same type as, the expected one."""
        t0 = time.monotonic()
        n = len(tests)
        if len(code) > MAX_CODE_CHARS:
            return ExecResult("failure", (False,) * n, (), "CodeTooLong", time.monotonic() - t0)
        reply, outcome = self.request({"code": code, "fn": fn, "tests": [[list(a), e] for a, e in tests],
                                       "time_s": self.run_timeout_s, "mem_mb": self.mem_mb})
        if reply is None:
            return ExecResult(outcome.status, (False,) * n, (), outcome.payload, outcome.latency_s)
        passed = tuple(bool(p) for p in reply.get("passed", ()))
        return ExecResult(str(reply["status"]), passed if len(passed) == n else (False,) * n,
                          tuple(str(o) for o in reply.get("outputs", ())), reply.get("error"),
                          time.monotonic() - t0)


class CodeSandboxPool(WorkerPool):
    worker_cls = CodeExecTool


def get_code_sandbox(size: int = 2, timeout_s: float = 1.0) -> CodeSandboxPool:
    """The process-wide sandbox pool for these settings."""
    return get_pool(CodeSandboxPool, size, timeout_s)


def run_example(code: str, example: Tests, pool: CodeSandboxPool | None = None) -> tuple[str, str, float]:
    """(status, the model-facing text inside <out>, latency) of running `code` on the visible example."""
    r = (pool or get_code_sandbox()).call(code, example)
    return r.status, run_payload(r.status, r.outputs[0] if r.outputs else None, r.error, all(r.passed)), r.latency_s


def grade(code: str | None, tests: Tests, pool: CodeSandboxPool | None = None) -> float:
    """The reward: the fraction of `tests` that `code` passes (0 without code)."""
    if code is None or not tests:
        return 0.0
    return (pool or get_code_sandbox()).call(code, tests).fraction
