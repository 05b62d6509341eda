"""The AReaL patches: applicable to pristine 1.0.4, idempotent, revertible, all-or-nothing."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from areal_libra import patches


@pytest.fixture()
def areal_copy(tmp_path: Path) -> Path:
    """A pristine copy of the installed AReaL (the installed one is patched: revert the copy)."""
    src = Path(patches.find_areal_root(None)) / "areal"
    shutil.copytree(src, tmp_path / "areal", ignore=shutil.ignore_patterns("__pycache__"))
    patches.revert(tmp_path, patches.load_patches())
    return tmp_path


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "areal_libra.patches", *args], capture_output=True, text=True)


def test_pristine_all_applicable(areal_copy: Path) -> None:
    rows = patches.plan(areal_copy, patches.load_patches())
    assert rows and all(state == "applicable" for _, state, _, _ in rows)
    r = _cli("check", "--areal-dir", str(areal_copy))
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("applicable") == len(rows)


def test_apply_is_idempotent_and_revert_restores(areal_copy: Path) -> None:
    before = {p: p.read_text() for p in (areal_copy / "areal").rglob("*.py")}
    assert _cli("apply", "--areal-dir", str(areal_copy)).returncode == 0
    after_once = {p: p.read_text() for p in before}
    assert after_once != before
    r = _cli("apply", "--areal-dir", str(areal_copy))
    assert r.returncode == 0 and "already applied" in r.stdout
    assert {p: p.read_text() for p in before} == after_once
    assert all(s == "applied" for _, s, _, _ in patches.plan(areal_copy, patches.load_patches()))
    assert _cli("revert", "--areal-dir", str(areal_copy)).returncode == 0
    assert {p: p.read_text() for p in before} == before


def test_modified_file_names_patch_and_hunk_and_writes_nothing(areal_copy: Path) -> None:
    target = areal_copy / "areal" / "infra" / "remote_inf_engine.py"
    text = target.read_text().replace("        self.server_idx = 0\n", "        self.server_idx = 7\n", 1)
    target.write_text(text)
    snapshot = {p: p.read_text() for p in (areal_copy / "areal").rglob("*.py")}
    r = _cli("check", "--areal-dir", str(areal_copy))
    assert r.returncode == 1
    assert "conflict" in r.stdout and "02-request-router-hook.patch" in r.stdout and "hunk 1" in r.stdout
    r = _cli("apply", "--areal-dir", str(areal_copy))
    assert r.returncode == 2 and "hunk 1" in r.stderr and "Traceback" not in r.stderr
    assert {p: p.read_text() for p in snapshot} == snapshot


def test_not_an_areal_dir(tmp_path: Path) -> None:
    r = _cli("status", "--areal-dir", str(tmp_path))
    assert r.returncode == 2 and "not an AReaL checkout" in r.stderr and "Traceback" not in r.stderr


def test_installed_areal_is_patched() -> None:
    rows = patches.plan(patches.find_areal_root(None), patches.load_patches())
    assert all(state == "applied" for _, state, _, _ in rows)
