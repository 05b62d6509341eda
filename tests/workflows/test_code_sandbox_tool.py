"""The code sandbox (issue 15): model-written code that tries to import os/socket/subprocess, write outside its
temp dir, reach the network, fork, take huge memory or loop forever gets a failure / timeout outcome (never an
exception), the host is untouched (no file appears, no process is left, the caller's memory does not grow),
and the sandbox answers normally afterwards; correct code passes the hidden tests, and the expected outputs
never reach the process that runs the code."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from areal_libra.workflows.sandbox import CodeExecTool
from tests.rigs.procs import descendants

TESTS = [([1], 4), ([2], 7), ([0], 1)]
GOOD = "def f(x):\n x=x*3\n x=x+1\n return x"
NOT_OK = ("failure", "timeout")
# Reaching os without `import`: the classic escape from restricted builtins.
OS = "[c for c in ().__class__.__base__.__subclasses__() if c.__name__ == '_wrap_close'][0].__init__.__globals__"


@pytest.fixture(scope="module")
def tool():
    t = CodeExecTool(timeout_s=1.0)
    assert t.call(GOOD, TESTS).fraction == 1.0  # worker up before anything is attempted
    yield t
    t.close()


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _fn(body: str) -> str:
    """A function f whose body runs `body` when called (so the attempt happens inside the tests)."""
    return "def f(x):\n" + "".join(f" {ln}\n" for ln in body.splitlines()) + " return x*3+1"


def _check_host_untouched(tool: CodeExecTool, before: set[int], marker) -> None:
    assert not marker.exists(), f"{marker} was created"
    # the worker keeps one pre-forked child (a fresh pid each call) ready for the next call; nothing else
    # (the previous child may take a moment to be reaped on a loaded machine)
    deadline = time.monotonic() + 10
    now = descendants(os.getpid())
    while len(now) > len(before) and time.monotonic() < deadline:
        time.sleep(0.05)
        now = descendants(os.getpid())
    assert len(now) <= len(before) and tool._proc.pid in now, f"processes left behind: {now - before}"
    assert tool.call(GOOD, TESTS).fraction == 1.0  # and the sandbox still works


ESCAPES = {
    "import": ["import os\nos.system('touch {m}')", "import subprocess\nsubprocess.run(['touch', '{m}'])",
               "import socket", "import ctypes", "from os import path", "__import__('shutil').rmtree('/tmp')",
               "import importlib", "import sys"],
    "builtins": ["open('{m}', 'w').write('x')", "exec('x=1')", "eval('1')", "compile('1', 'a', 'eval')"],
    "via_os": [f"{OS}['system']('touch {{m}}')", f"{OS}['open']('{{m}}', 65)", f"{OS}['fork']()",
               f"{OS}['kill'](1, 0)", f"{OS}['execv']('/bin/sh', ['sh'])", f"{OS}['chdir']('/')",
               f"{OS}['listdir']('/')", f"{OS}['remove']('{{m}}')", f"{OS}['symlink']('/', 'l')\n{OS}['listdir']('l')"],
    "via_io": [
        "[c for c in ().__class__.__base__.__subclasses__() if c.__name__ == 'FileIO'][0]('{m}', 'w')",
        "[c for c in ().__class__.__base__.__subclasses__() if c.__name__ == 'FileIO'][0]('/etc/passwd')",
    ],
}


@pytest.mark.parametrize(("kind", "body"), [(k, b) for k, bs in ESCAPES.items() for b in bs])
def test_escapes_are_refused(tool, tmp_path, kind, body):
    marker = tmp_path / "pwned"
    before = descendants(os.getpid())
    r = tool.call(_fn(body.format(m=marker)), TESTS)
    assert r.status == "failure" and r.fraction == 0.0, (kind, r)
    _check_host_untouched(tool, before, marker)


def test_writes_inside_the_temp_dir_are_allowed_and_removed(tool, tmp_path):
    code = _fn(f"p = {OS}['getcwd']()\nd = {OS}['open']('scratch', 65)")
    r = tool.call(code, TESTS)
    assert r.status == "success" and r.fraction == 1.0, r
    # only the pre-forked child's fresh (empty) directory is left; all of it goes with the worker
    left = os.listdir(tool.base_dir)
    assert len(left) == 1 and not os.listdir(os.path.join(tool.base_dir, left[0]))
    other = CodeExecTool(timeout_s=1.0)
    assert other.call(code, TESTS).fraction == 1.0
    base = other.base_dir
    other.close()
    assert not os.path.exists(base)


def test_a_killed_caller_leaves_nothing_behind(tmp_path):
    """The caller (a trainer killed with SIGKILL, which runs no clean-up) is gone: the worker sees its
    stdin close, ends its pre-forked child and removes the temp dirs."""
    import signal
    import subprocess
    import sys

    script = ("import sys; from areal_libra.workflows.sandbox import CodeExecTool\n"
              "t = CodeExecTool(1.0); t.call('def f(x): return x', [([1], 1)])\n"
              "print(t.base_dir, t._proc.pid, flush=True); sys.stdin.read()")
    caller = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, cwd=Path(__file__).resolve().parents[2])
    base, worker = caller.stdout.readline().split()
    assert os.path.isdir(base) and os.listdir(base)
    caller.send_signal(signal.SIGKILL)
    caller.wait()
    for _ in range(100):
        if not os.path.exists(base) and not os.path.exists(f"/proc/{worker}"):
            break
        time.sleep(0.05)
    assert not os.path.exists(base), "temp dirs left behind"
    assert not os.path.exists(f"/proc/{worker}") or "Z" in open(f"/proc/{worker}/stat").read().split()[2]


def test_network_is_refused(tool, tmp_path):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0.5)
    port = srv.getsockname()[1]
    sock = "[c for c in ().__class__.__base__.__subclasses__() if c.__name__ == 'socket'][0]"
    for body in (f"import socket\nsocket.create_connection(('127.0.0.1', {port}))",
                 f"{sock}().connect(('127.0.0.1', {port}))"):
        r = tool.call(_fn(body), TESTS)
        assert r.status == "failure", (body, r)
    with pytest.raises(TimeoutError):  # nobody connected
        srv.accept()
    srv.close()


@pytest.mark.parametrize("body", [f"while True:\n {OS}['fork']()", "while True:\n pass",
                                  "def g(): return g()\ng()"])
def test_fork_bombs_loops_and_recursion_end(tool, tmp_path, body):
    before = descendants(os.getpid())
    t0 = time.monotonic()
    r = tool.call(_fn(body), TESTS)
    assert r.status in NOT_OK and r.fraction == 0.0, r
    assert time.monotonic() - t0 < 10  # bounded, with room for a loaded machine
    _check_host_untouched(tool, before, tmp_path / "none")


def test_infinite_loop_is_a_timeout(tool, tmp_path):
    before = descendants(os.getpid())
    r = tool.call(_fn("while True:\n pass"), TESTS)
    assert r.status == "timeout" and r.error.startswith("Timeout"), r
    r = tool.call("while True:\n pass", TESTS)  # at definition time too
    assert r.status == "timeout", r
    _check_host_untouched(tool, before, tmp_path / "none")


@pytest.mark.parametrize("body", ["y = [0] * 10**9", "y = 'a' * 10**10", "y = 2**(2**34)",
                                  "y = [[0] * 1000 for _ in range(10**6)]"])
def test_huge_memory_is_refused(tool, tmp_path, body):
    before, rss0 = descendants(os.getpid()), _rss_kib()
    t0 = time.monotonic()
    r = tool.call(_fn(body), TESTS)
    assert r.status in NOT_OK and r.fraction == 0.0, r
    assert time.monotonic() - t0 < 10  # bounded, with room for a loaded machine
    assert _rss_kib() - rss0 < 50_000  # the caller did not absorb it
    _check_host_untouched(tool, before, tmp_path / "none")


def test_limits_apply_in_the_child(tool):
    code = _fn(f"t = {OS}['read']({OS}['open']('/proc/self/limits', 0), 4096).decode()")
    # reading /proc is outside the temp dir, so even this is refused; the limits are checked from outside
    assert tool.call(code, TESTS).status == "failure"
    child = next(iter(descendants(tool._proc.pid)))  # the pre-forked child waiting for the next call
    for _ in range(100):  # it sets its limits right after the fork
        with open(f"/proc/{child}/limits") as f:
            limits = {ln[:26].strip(): ln[26:].split()[:2] for ln in f}
        if limits["Max processes"] == ["0", "0"]:
            break
        time.sleep(0.01)
    assert limits["Max address space"] == [str(256 << 20)] * 2
    assert limits["Max cpu time"] == ["2", "2"]
    assert limits["Max processes"] == ["0", "0"]
    status = open(f"/proc/{child}/status").read()
    uid = next(ln.split()[1] for ln in status.splitlines() if ln.startswith("Uid:"))
    assert uid == ("65534" if os.getuid() == 0 else str(os.getuid()))


def test_correct_code_passes_and_partial_credit(tool):
    assert tool.call(GOOD, TESTS).passed == (True, True, True)
    r = tool.call("def f(x):\n return max(x*3+1, 5)", TESTS)  # right for x >= 2 only
    assert r.status == "success" and r.passed == (False, True, False) and r.fraction == pytest.approx(1 / 3)
    r = tool.call("def f(x):\n return str(x*3+1)", TESTS)  # the right digits, the wrong type
    assert r.status == "success" and r.fraction == 0.0 and r.outputs == ('"4"', '"7"', '"1"')
    assert tool.call("def g(x):\n return x", TESTS).status == "failure"  # no f
    r = tool.call("def f(x):\n return 10 // (x - 1)", TESTS)  # raises on one input
    assert r.status == "failure" and r.error == "ZeroDivisionError" and r.passed == (False, False, False)


def _memory_holds(pid: int, needle: bytes) -> bool:
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb") as mem:
        for line in maps:
            addr, perms = line.split()[:2]
            if not perms.startswith("r"):
                continue
            lo, hi = (int(a, 16) for a in addr.split("-"))
            try:
                mem.seek(lo)
                if needle in mem.read(hi - lo):
                    return True
            except (OSError, ValueError, OverflowError):
                continue
    return False


def test_expected_outputs_never_reach_the_code():
    """The child is forked before the request is read and gets only the inputs: while the code runs, the
    hidden answer is nowhere in its memory (the input is, which shows the scan works)."""
    import threading

    secret, arg = 987654321123, 424242424243
    slow = CodeExecTool(timeout_s=5.0)
    try:
        assert slow.call(GOOD, TESTS).fraction == 1.0
        got = {}
        th = threading.Thread(target=lambda: got.setdefault(
            "r", slow.call(_fn("while True:\n pass"), [([arg], secret)])))
        th.start()
        seen = False
        deadline = time.monotonic() + 4.0
        while not seen and time.monotonic() < deadline:  # until the running child holds the request
            for child in descendants(slow._proc.pid):
                if _memory_holds(child, str(arg).encode()):
                    seen = True
                    assert not _memory_holds(child, str(secret).encode())
            time.sleep(0.05)
        assert seen, "the running child never showed the input"
        th.join()
        assert got["r"].status == "timeout"
    finally:
        slow.close()
