"""The calculator tool is a sandbox (issue 13): attempts to import, open files, spawn processes, allocate
huge memory or run forever are refused or time out, come back as tool outcomes (never exceptions), and
leave the host untouched: no file appears, no process is left behind, the caller's memory does not grow,
and the tool answers normally afterwards."""

from __future__ import annotations

import os
import time

import pytest

from areal_libra.workflows.tools import CalculatorTool
from tests.rigs.procs import children

NOT_OK = ("failure", "timeout")


@pytest.fixture
def tool():
    t = CalculatorTool(timeout_s=1.0)
    assert t.call("1+1").payload == "2"  # worker up before anything is attempted
    yield t
    t.close()


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _check_host_untouched(tool: CalculatorTool, before: set[int], marker) -> None:
    assert not marker.exists(), f"{marker} was created"
    assert children(os.getpid()) <= before | ({tool._proc.pid} if tool._proc else set()), "a process was left behind"
    assert tool.call("6*7").payload == "42"  # and the tool still works


ESCAPES = {
    "import": ["__import__('os')", "import os", "__builtins__", "().__class__.__bases__[0].__subclasses__()",
               "(lambda: 0)()", "[x for x in (1,)]"],
    "open": ["open('{m}', 'w').write('x')", "__import__('pathlib').Path('{m}').touch()"],
    "spawn": ["__import__('os').system('touch {m}')", "__import__('subprocess').run(['touch', '{m}'])",
              "__import__('os').fork()"],
}


@pytest.mark.parametrize(("kind", "expr"), [(k, e) for k, es in ESCAPES.items() for e in es])
def test_escapes_are_refused(tool, tmp_path, kind, expr):
    marker = tmp_path / "pwned"
    before = children(os.getpid())
    r = tool.call(expr.format(m=marker))
    assert r.status == "failure", (kind, r)
    _check_host_untouched(tool, before, marker)


@pytest.mark.parametrize("expr", [
    "2**(2**40)",  # 128 GiB of bits: refused by the worker's memory limit, not allocated
    "10**(10**10)",
    "(10**9)**(10**9)",
    "9**9**9**9",
])
def test_huge_memory_is_refused_or_times_out(tool, tmp_path, expr):
    before, rss0 = children(os.getpid()), _rss_kib()
    t0 = time.monotonic()
    r = tool.call(expr)
    assert r.status in NOT_OK, r
    assert time.monotonic() - t0 < 10  # bounded, with room for a loaded machine
    assert _rss_kib() - rss0 < 50_000  # the caller did not absorb it
    _check_host_untouched(tool, before, tmp_path / "none")


def test_memory_limit_applies_in_the_worker(tool):
    # Whatever a call computes before it times out, the worker cannot take more than 1 GiB of address
    # space (a limit the worker sets on itself: the caller's own limits are not touched).
    with open(f"/proc/{tool._proc.pid}/limits") as f:
        line = next(ln for ln in f if ln.startswith("Max address space"))
    assert line.split()[3:5] == [str(1 << 30), str(1 << 30)], line


@pytest.mark.parametrize("expr", ["9**9**9", "(7**7**7)**(7**7)", "-(-(-(9**9**9)))"])
def test_endless_computation_times_out_and_is_killed(tool, tmp_path, expr):
    before = children(os.getpid())
    old = tool._proc.pid
    t0 = time.monotonic()
    r = tool.call(expr)
    assert r.status == "timeout", r
    assert time.monotonic() - t0 < 10  # bounded, with room for a loaded machine
    assert old not in children(os.getpid())  # killed and reaped, not left running
    _check_host_untouched(tool, before, tmp_path / "none")


@pytest.mark.parametrize("expr", ["1+" * 5_000_000 + "1", "(" * 300 + "1" + ")" * 300,
                                  "\x00", "'a'*10**9", "1" * 300, ""])
def test_malformed_or_huge_input_is_a_failure(tool, tmp_path, expr):
    before = children(os.getpid())
    t0 = time.monotonic()
    r = tool.call(expr)
    assert r.status == "failure", r
    assert time.monotonic() - t0 < 10  # bounded, with room for a loaded machine
    _check_host_untouched(tool, before, tmp_path / "none")
