"""The one atomic-write and process-liveness helpers (areal_libra/utils.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from areal_libra.utils import atomic_write_bytes, atomic_write_text, pid_alive


def test_atomic_write_replaces_whole_files_and_keeps_an_existing_files_permissions(tmp_path):
    new = tmp_path / "sub" / "new.json"
    atomic_write_text(new, "{}\n")  # the folder is made
    assert new.read_text() == "{}\n" and (new.stat().st_mode & 0o777) == 0o600
    src = tmp_path / "module.py"  # as a patched source file of an installed package
    src.write_text("old\n")
    os.chmod(src, 0o644)
    atomic_write_text(src, "new\n")
    assert src.read_text() == "new\n" and (src.stat().st_mode & 0o777) == 0o644
    atomic_write_bytes(src, b"\x00\x01")
    assert src.read_bytes() == b"\x00\x01" and (src.stat().st_mode & 0o777) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["module.py", "sub"]  # no temp file left


def test_a_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path):
    f = tmp_path / "state.json"
    f.write_text("kept")
    with pytest.raises(TypeError):
        atomic_write_bytes(f, "not bytes")  # type: ignore[arg-type]
    assert f.read_text() == "kept" and [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_pid_alive_counts_a_zombie_as_dead():
    assert pid_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.time() + 30
    while pid_alive(child.pid):  # exited but not reaped yet: a zombie
        assert time.time() < deadline, "an exited, unreaped child still counts as alive"
        time.sleep(0.05)
    assert os.path.exists(f"/proc/{child.pid}")  # still a zombie: not reaped until wait()
    child.wait()
    assert not pid_alive(child.pid)


def test_read_jsonl_skips_a_cut_line_and_a_missing_file_is_empty(tmp_path):
    from areal_libra.utils import append_jsonl, read_jsonl

    p = tmp_path / "x.jsonl"
    assert read_jsonl(p) == []
    append_jsonl(p, {"a": 1})
    with open(p, "a") as f:
        f.write('{"a": 2\n')  # cut by a kill
    append_jsonl(p, {"a": 3})
    assert read_jsonl(p) == [{"a": 1}, {"a": 3}]
