"""Code-execution worker (stdlib only, started with `python -I -S`): one JSON request per stdin line, one JSON
reply per stdout line. Each request runs in a fresh child process forked *before* the request was read, so
the child never holds the expected outputs (the hidden tests' answers stay in this process, which compares).

The child, before it reads the untrusted code: its own session (killed as a group), stdin/stdout/stderr on
/dev/null, cwd = a fresh temp dir, rlimits (address space, CPU seconds, file size, open files, no core
files), uid/gid `nobody` when started as root (so RLIMIT_NPROC=0 forbids forking and the file system's
permissions apply), then an audit hook that refuses process creation, signals, sockets, ctypes, new
imports, and any file access outside the temp dir; the code runs with builtins lacking open/exec/eval/
compile/input and with an __import__ that admits only a few pure modules (preloaded here). A run past its
wall-clock limit is killed with its process group and reported as a timeout.

Request: {"code": str, "fn": str, "tests": [[args, expected], ...], "time_s": float, "mem_mb": int}
Reply:   {"status": "success"|"failure"|"timeout", "error": str|null, "passed": [bool], "outputs": [str]}
status is "failure" when the code does not define `fn`, a test raised, or the child died."""

import builtins
import json
import os
import resource
import select
import shutil
import signal
import sys
import tempfile
import time

# Pure modules the code may import; loaded here so the child never imports anything new.
ALLOWED_MODULES = ("math", "string", "re", "itertools", "functools", "collections", "operator", "heapq",
                   "bisect", "fractions", "statistics", "random")
for _m in ALLOWED_MODULES:
    __import__(_m)

_REMOVED_BUILTINS = ("open", "exec", "eval", "compile", "input", "breakpoint", "help", "exit", "quit",
                     "globals", "locals", "vars", "memoryview", "copyright", "credits", "license")
_REFUSED_EVENTS = ("os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork", "os.forkpty", "os.kill",
                   "os.killpg", "os.chdir", "os.chroot", "os.putenv", "os.unsetenv", "os.setuid", "subprocess.",
                   "socket.", "ctypes.", "resource.", "signal.", "pty.", "fcntl.", "mmap.", "import",
                   "sys._getframe", "sys._current_frames", "urllib.", "http.", "ftplib.", "smtplib.",
                   "webbrowser.", "winreg.", "sqlite3.")
_PATH_EVENTS = ("open", "os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link",
                "os.truncate", "os.chmod", "os.chown", "os.utime", "os.listdir", "os.scandir", "os.chflags",
                "os.lchflags", "os.lchmod", "os.mkfifo", "os.mknod", "glob.glob", "shutil.")
NOBODY = 65534
BASE_DIR = sys.argv[1] if len(sys.argv) > 1 else None  # the runs' temp dirs go here (removed by the caller)
MAX_OUTPUT_CHARS = 200


def _inside(path, root: str) -> bool:
    if isinstance(path, int):
        return False  # a raw descriptor: none of the code's business
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not isinstance(path, str):
        path = os.fspath(path)
    real = os.path.realpath(os.path.join(root, path))
    return real == root or real.startswith(root + os.sep)


def _guard(root: str):
    def hook(event: str, args: tuple) -> None:
        if event.startswith(_REFUSED_EVENTS):
            raise PermissionError(f"sandbox: {event} refused")
        if event.startswith(_PATH_EVENTS):
            n = 2 if event.startswith(("os.rename", "os.link", "os.symlink", "shutil.")) else 1
            if not all(p is None or _inside(p, root) for p in args[:n]):
                raise PermissionError(f"sandbox: {event} outside the sandbox directory refused")

    return hook


def _safe_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level != 0 or name.partition(".")[0] not in ALLOWED_MODULES:
        raise ImportError(f"import of {name} is not allowed")
    return sys.modules[name.partition(".")[0]] if not fromlist else sys.modules[name]


def _safe_builtins() -> dict:
    b = {k: v for k, v in vars(builtins).items() if k not in _REMOVED_BUILTINS}
    b["__import__"] = _safe_import
    return b


def _encode(value) -> str:
    """The returned value as JSON text (compared by the parent); big or odd values become their type name."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        return json.dumps(f"<int of {value.bit_length()} bits>")
    if isinstance(value, str) and len(value) > MAX_OUTPUT_CHARS:
        return json.dumps(value[:MAX_OUTPUT_CHARS] + "...")
    if value is None or isinstance(value, (bool, int, float, str)):
        return json.dumps(value)
    return json.dumps(f"<{type(value).__name__}>")


def _limit(time_s: float, mem_mb: int) -> None:
    cpu = int(time_s) + 1
    for lim, val in ((resource.RLIMIT_AS, mem_mb << 20), (resource.RLIMIT_CPU, cpu),
                     (resource.RLIMIT_FSIZE, 1 << 20), (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(lim, (val, val))


def _child(req_r: int, res_w: int, root: str, time_s: float, mem_mb: int) -> None:
    """Runs in the forked child; never returns."""
    code = 1
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.chdir(root)
        _limit(time_s, mem_mb)
        if os.getuid() == 0:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
        resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
        chunks = []
        while True:
            chunk = os.read(req_r, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
        req = json.loads(b"".join(chunks))
        sys.addaudithook(_guard(root))
        out = {"error": None, "outputs": []}
        scope = {"__builtins__": _safe_builtins(), "__name__": "solution"}
        try:
            exec(req["code"], scope)
            fn = scope.get(req["fn"])
            if not callable(fn):
                raise NameError(f"{req['fn']} is not defined")
        except BaseException as e:  # noqa: BLE001 - the code's failure is the outcome
            out["error"] = type(e).__name__
        else:
            for args in req["args"]:
                try:
                    out["outputs"].append(["ok", _encode(fn(*args))])
                except BaseException as e:  # noqa: BLE001
                    out["outputs"].append(["error", type(e).__name__])
        data = json.dumps(out).encode()
        while data:
            data = data[os.write(res_w, data):]
        code = 0
    finally:
        os._exit(code)


def _spawn(time_s: float, mem_mb: int):
    root = tempfile.mkdtemp(prefix="run-", dir=BASE_DIR)
    if os.getuid() == 0:
        os.chown(root, NOBODY, NOBODY)
    req_r, req_w = os.pipe()
    res_r, res_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(req_w)
        os.close(res_r)
        _child(req_r, res_w, os.path.realpath(root), time_s, mem_mb)
    os.close(req_r)
    os.close(res_w)
    return pid, req_w, res_r, root


def _kill(pid: int) -> None:
    for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            target()
        except (ProcessLookupError, PermissionError):
            pass


def run(req: dict, child) -> dict:
    pid, req_w, res_r, root = child
    tests = req["tests"]
    time_s = float(req.get("time_s", 1.0))
    reply = {"status": "failure", "error": None, "passed": [False] * len(tests), "outputs": []}
    try:
        payload = json.dumps({"code": str(req["code"]), "fn": str(req.get("fn", "f")),
                              "args": [list(a) for a, _ in tests]}).encode()
        try:
            while payload:
                payload = payload[os.write(req_w, payload):]
        except BrokenPipeError:
            pass
        os.close(req_w)
        deadline = time.monotonic() + time_s
        chunks = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([res_r], [], [], left)[0]:
                reply["status"], reply["error"] = "timeout", f"Timeout after {time_s:g} s"
                break
            chunk = os.read(res_r, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        _kill(pid)  # the whole group: nothing it started outlives the call
        _, status = os.waitpid(pid, 0)
        os.close(res_r)
        shutil.rmtree(root, ignore_errors=True)
    if reply["status"] == "timeout":
        return reply
    try:
        out = json.loads(b"".join(chunks))
        results = out["outputs"]
    except (ValueError, KeyError, TypeError):
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        reply["error"] = f"Killed by signal {sig}" if sig else "Crashed"
        return reply
    if out.get("error"):
        reply["error"] = str(out["error"])
        return reply
    errors = []
    for i, ((_args, expected), res) in enumerate(zip(tests, results)):
        kind, text = res
        if kind == "ok":
            value = json.loads(text)
            reply["passed"][i] = type(value) is type(expected) and value == expected
            reply["outputs"].append(text)
        else:
            errors.append(text)
            reply["outputs"].append(text)
    reply["status"] = "failure" if errors or len(results) != len(tests) else "success"
    reply["error"] = errors[0] if errors else None
    return reply


def _discard(child) -> None:
    pid, req_w, res_r, root = child
    _kill(pid)
    os.waitpid(pid, 0)
    os.close(req_w)
    os.close(res_r)
    shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    child, limits = None, None
    for line in sys.stdin:
        try:
            req = json.loads(line)
            want = (float(req.get("time_s", 1.0)), int(req.get("mem_mb", 256)))
            if not (0 < want[0] <= 60 and 16 <= want[1] <= 4096):
                raise ValueError("limits out of range")
            if child is not None and limits != want:
                _discard(child)
                child = None
            if child is None:
                child, limits = _spawn(*want), want
            current, child = child, None
            reply = run(req, current)
            child, limits = _spawn(*want), want  # forked before the next request is read
        except Exception as e:  # noqa: BLE001 - a malformed request is a failure, not a dead worker
            reply = {"status": "failure", "error": f"WorkerError: {type(e).__name__}", "passed": [],
                     "outputs": []}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    # stdin closed: the caller is gone (even if it was killed and could not clean up): leave nothing behind
    if child is not None:
        _discard(child)
    if BASE_DIR is not None:
        shutil.rmtree(BASE_DIR, ignore_errors=True)


if __name__ == "__main__":
    main()
