"""The sandboxed calculator: outcomes, timeouts, respawn, cost."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from areal_libra.workflows.tools import MAX_PAYLOAD_CHARS, CalculatorPool, CalculatorTool


@pytest.fixture
def tool():
    t = CalculatorTool(timeout_s=0.5)
    yield t
    t.close()


@pytest.mark.parametrize(
    "expr, status, payload",
    [
        ("37*12+5", "success", "449"),
        ("(2+3)*-4", "success", "-20"),
        ("7/2", "success", "3.5"),
        ("8/2", "success", "4"),
        ("1/0", "failure", "ZeroDivisionError: division by zero"),
        ("__import__('os').system('true')", "failure", "ValueError: unsupported syntax: Call"),
        ("open('/etc/passwd')", "failure", "ValueError: unsupported syntax: Call"),
        ("x+1", "failure", "ValueError: unsupported syntax: Name"),
        ("2+", "failure", "SyntaxError"),
    ],
)
def test_outcomes(tool, expr, status, payload):
    r = tool.call(expr)
    assert r.status == status
    assert r.payload.startswith(payload)
    assert r.latency_s >= 0


def test_huge_results_are_failures_and_payloads_are_clipped(tool):
    r = tool.call("10**5000")
    assert r.status == "failure" and len(r.payload) <= MAX_PAYLOAD_CHARS
    r = tool.call("1" * 60 + "*" + "1" * 10)
    assert r.status == "success" and len(r.payload) == MAX_PAYLOAD_CHARS and r.payload.endswith("...")


def test_timeout_kills_and_respawns(tool):
    assert tool.call("1+1").payload == "2"
    pid = tool._proc.pid
    t0 = time.monotonic()
    r = tool.call("9**9**9")  # runs for minutes: must come back as a timeout after ~0.5 s
    assert r.status == "timeout" and "0.5 s" in r.payload
    assert 0.45 <= time.monotonic() - t0 < 10  # bounded, with room for a loaded machine
    assert tool.respawns == 1
    assert tool.call("2*21").payload == "42" and tool._proc.pid != pid


def test_dead_worker_is_a_failure_then_recovers(tool):
    assert tool.call("1+1").status == "success"
    os.kill(tool._proc.pid, signal.SIGKILL)
    tool._proc.wait()
    # The next call finds the worker gone and starts a new one (poll() sees the exit).
    assert tool.call("3*3").payload == "9"


def test_one_worker_serves_many_calls(tool):
    """What keeps a call cheap: the worker process is reused, not started per call."""
    tool.call("1+1")
    pid = tool._proc.pid
    for i in range(300):
        assert tool.call(f"{i}*2+1").payload == str(i * 2 + 1)
    assert tool._proc.pid == pid and tool.respawns == 0


def test_pool_runs_calls_concurrently():
    pool = CalculatorPool(size=2, timeout_s=0.5)
    try:
        for t in pool._tools:  # start both workers outside the timed part
            assert t.call("0").status == "success"

        async def go():
            return await asyncio.gather(pool.acall("9**9**9"), *[pool.acall(f"{i}+1") for i in range(20)])

        t0 = time.monotonic()
        slow, *fast = asyncio.run(go())
        assert slow.status == "timeout"
        assert [r.payload for r in fast] == [str(i + 1) for i in range(20)]
        assert max(r.latency_s for r in fast) < slow.latency_s  # the hung call did not hold the other worker
        assert time.monotonic() - t0 < 10  # bounded, with room for a loaded machine
    finally:
        pool.close()
