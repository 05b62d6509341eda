"""The embedded server is a leaf of the package: nothing in areal_libra/server imports areal_libra.rollout or
areal_libra.live, at module level or inside a function (an emulated server gets its pacing injected by
areal_libra.rollout.emulation)."""

from __future__ import annotations

import ast
from pathlib import Path

import areal_libra.server

FORBIDDEN = ("areal_libra.rollout", "areal_libra.live")
SERVER = Path(areal_libra.server.__file__).parent


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, functions included; relative imports resolved, and
    `from areal_libra import rollout` counted as areal_libra.rollout."""
    package = "areal_libra.server"
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((node.lineno, mod))
            out += [(node.lineno, f"{mod}.{a.name}") for a in node.names]
    return out


def _forbidden(mod: str) -> bool:
    return any(mod == f or mod.startswith(f + ".") for f in FORBIDDEN)


def test_the_scan_sees_imports_inside_functions_and_relative_ones(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import os\n\ndef f():\n    from areal_libra.rollout.emulation import x\n\n"
                   "def g():\n    from ..live import train\n    from areal_libra import rollout\n")
    bad = [m for _, m in imported_modules(src) if _forbidden(m)]
    assert bad == ["areal_libra.rollout.emulation", "areal_libra.rollout.emulation.x", "areal_libra.live",
                   "areal_libra.live.train", "areal_libra.rollout"]


def test_server_imports_nothing_from_rollout_or_live():
    files = sorted(SERVER.rglob("*.py"))
    assert len(files) >= 5  # the scan found the package
    bad = [f"{p.relative_to(SERVER.parent)}:{line}: {mod}" for p in files for line, mod in imported_modules(p)
           if _forbidden(mod)]
    assert not bad, "server/ must stay a leaf:\n" + "\n".join(bad)
