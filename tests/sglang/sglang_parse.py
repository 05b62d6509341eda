"""Parse server command lines with the pinned SGLang's own ServerArgs, in a process of its own.

    python tests/sglang/sglang_parse.py < argvs.json    # a JSON list of argvs (after `-m sglang.launch_server`)

Prints one JSON object: {"parsed": [{"tp_size", "random_seed", "port", "dist_init_addr"} per argv]} or
{"error": "<why sglang.srt.server_args does not import>"}.

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
import importlib.abc
import importlib.machinery
import json
import sys
import types


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


def main() -> int:
    argvs = json.load(sys.stdin)
    if not _torchvision_imports():
        sys.meta_path.insert(0, _TorchvisionStandIn())
    try:
        from sglang.srt.server_args import ServerArgs
    except Exception as e:  # noqa: BLE001 - report any import failure as the reason to skip
        print(json.dumps({"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}))
        return 0
    parsed = []
    for argv in argvs:
        parser = argparse.ArgumentParser(exit_on_error=False)
        ServerArgs.add_cli_args(parser)
        ns = parser.parse_args(argv)
        parsed.append({"tp_size": getattr(ns, "tp_size", getattr(ns, "tensor_parallel_size", None)),
                       "random_seed": ns.random_seed, "port": ns.port, "dist_init_addr": ns.dist_init_addr})
    print(json.dumps({"parsed": parsed}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
