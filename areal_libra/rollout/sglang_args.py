"""Server command lines checked by the installed SGLang's own ServerArgs (add_cli_args + parse_args), in a
process of their own: `launch --dry-run` and tests/sglang use it.

    parse_command_lines([argv_after_launch_server, ...])  # [{"tp_size", "random_seed", "port", ...}]
    python -m areal_libra.rollout.sglang_args < argvs.jsonl  # the child: one JSON list of argvs a line

For each line the child prints one line: {"parsed": [...]} or {"refused": "<argparse's reason>", "argv": i} or
{"error": "<why sglang.srt.server_args does not import>"}. Importing sglang.srt.server_args takes 10-20 s of
CPU, so one child serves every parse of the process that started it (a dry run parses once; the test session
many times) and exits when its stdin closes.

On a CPU-only machine the import chain of sglang.srt.server_args reaches `from torchvision.io import
decode_jpeg` (sglang/srt/utils/common.py) and transformers' `torchvision.transforms` names; PyPI's torchvision
is the CUDA build, whose compiled operators do not load against a CPU torch, and nothing of it is used to
parse arguments. So, only when torchvision cannot be imported, this process (never the test session) puts a
stand-in package on the import path whose attributes are inert placeholders; everything else is the real
SGLang, triton and transformers (requirements/sglang-cpu.txt). A separate process keeps the stand-in away
from every other test.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import select
import subprocess
import sys
import tempfile
import threading
import types


class SGLangArgsError(ValueError):
    """SGLang's ServerArgs refuses a command line."""


class SGLangUnavailable(RuntimeError):
    """sglang (or its sglang.srt.server_args) does not import here: nothing was parsed."""


def parse_command_lines(argvs: list[list[str]], timeout: float = 600.0) -> list[dict]:
    """Each argv (after `python -m sglang.launch_server`) parsed by SGLang's ServerArgs in a child process:
    the fields AReaL's launch depends on. SGLangArgsError names a refused line; SGLangUnavailable says why
    nothing could be parsed."""
    if importlib.util.find_spec("sglang") is None:
        raise SGLangUnavailable("sglang is not installed here")
    out = _CHILD.ask(argvs, timeout)
    if "error" in out:
        raise SGLangUnavailable(f"sglang.srt.server_args does not import here ({out['error']})")
    if "refused" in out:
        raise SGLangArgsError(f"SGLang's ServerArgs refuses a server command line ({out['refused']}): "
                              f"{' '.join(argvs[out['argv']])}")
    return out["parsed"]


class _Child:
    """The parsing process, started on first use and kept for the next parse (module docstring)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._stderr = None
        self._lock = threading.Lock()

    def _start(self) -> subprocess.Popen:
        # stderr to a file: a pipe nobody reads would fill with the import's warnings and stall the child.
        self._stderr = tempfile.TemporaryFile(mode="w+")
        return subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=self._stderr, text=True, bufsize=1)

    def _stop(self, grace_s: float) -> tuple[int | None, str]:
        """End the child (its input closed, killed after `grace_s`) and drop its stderr file: (rc, stderr tail)."""
        proc, self._proc = self._proc, None
        rc = None
        if proc is not None:
            try:
                proc.stdin.close()  # the child exits at the end of its input
            except OSError:
                pass
            try:
                rc = proc.wait(timeout=grace_s) if grace_s > 0 else proc.poll()
            except subprocess.TimeoutExpired:
                pass
            if rc is None:
                proc.kill()
                rc = proc.wait()
        tail = ""
        if self._stderr is not None:
            self._stderr.seek(0)
            tail = self._stderr.read().strip()[-500:]
            self._stderr.close()
            self._stderr = None
        return rc, tail

    def _fail(self, why: str) -> SGLangUnavailable:
        rc, tail = self._stop(0)
        return SGLangUnavailable(f"the parsing process {why} (rc {rc}): {tail}")

    def ask(self, argvs: list[list[str]], timeout: float) -> dict:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._stop(0)  # a child that died since the last parse: its stderr file goes with it
                self._proc = self._start()
            proc = self._proc
            try:
                proc.stdin.write(json.dumps(argvs) + "\n")
                proc.stdin.flush()
            except OSError:
                raise self._fail("failed") from None
            ready, _, _ = select.select([proc.stdout], [], [], timeout)
            line = proc.stdout.readline() if ready else None
            if line is None:
                raise self._fail(f"answered nothing in {timeout:.0f} s")
            if not line.strip():
                raise self._fail("failed")
            return json.loads(line)

    def close(self) -> None:
        with self._lock:
            self._stop(10.0)


_CHILD = _Child()
atexit.register(_CHILD.close)


class _Placeholder:
    """Any attribute, call or item of a stand-in module: inert (never used to parse arguments)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, key: str):
        if key.startswith("__"):
            raise AttributeError(key)
        return _Placeholder(f"{self._name}.{key}")

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a decorator
        return _Placeholder(f"{self._name}()")

    def __repr__(self) -> str:
        return f"<torchvision stand-in {self._name}>"


class _StandInModule(types.ModuleType):
    def __getattr__(self, key: str):
        if key.startswith("__"):
            raise AttributeError(key)
        return _Placeholder(f"{self.__name__}.{key}")


class _TorchvisionStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0+stand-in"
        return module

    def exec_module(self, module) -> None:
        pass


def _torchvision_imports() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - the CUDA build raises RuntimeError on a CPU torch, not ImportError
        for key in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
            del sys.modules[key]
        return False
    return True


def _parse_all(server_args, argvs: list[list[str]]) -> dict:
    parsed = []
    for i, argv in enumerate(argvs):
        parser = argparse.ArgumentParser(exit_on_error=False)
        server_args.add_cli_args(parser)
        try:
            ns, unknown = parser.parse_known_args(argv)
        except (argparse.ArgumentError, SystemExit) as e:  # a bad value; a missing one exits even so
            unknown, ns = None, str(e)
        if unknown is None or unknown:
            why = ns if unknown is None else f"unrecognized arguments: {' '.join(unknown)}"
            return {"refused": why, "argv": i}
        parsed.append({"tp_size": getattr(ns, "tp_size", getattr(ns, "tensor_parallel_size", None)),
                       "random_seed": ns.random_seed, "port": ns.port, "dist_init_addr": ns.dist_init_addr,
                       "mem_fraction_static": ns.mem_fraction_static, "context_length": ns.context_length,
                       "disable_radix_cache": ns.disable_radix_cache, "schedule_policy": ns.schedule_policy,
                       "enable_priority_scheduling": ns.enable_priority_scheduling,
                       "schedule_low_priority_values_first": ns.schedule_low_priority_values_first,
                       "disable_priority_preemption": ns.disable_priority_preemption})
    return {"parsed": parsed}


def main() -> int:
    # The answers go to the stdout the parent reads; anything the imports print (Python or C) goes to stderr.
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    if not _torchvision_imports():
        sys.meta_path.insert(0, _TorchvisionStandIn())
    server_args, error = None, None
    try:
        from sglang.srt.server_args import ServerArgs as server_args
    except Exception as e:  # noqa: BLE001 - report any import failure as the reason to skip
        error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    for line in sys.stdin:
        if not line.strip():
            continue
        argvs = json.loads(line)
        out = {"error": error} if server_args is None else _parse_all(server_args, argvs)
        print(json.dumps(out), file=answers, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
