"""The launcher's supervision when every rollout server is dead: at once without server replacement, after
the grace period with it (libra mode: the trainer starts a replacement, rollout/revive.py), and not at
all when a serving server appears in servers.json within the grace period."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from areal_libra.launch import LaunchError, supervise
from areal_libra.utils import atomic_write_text


def _registry(run_dir: Path, pid: int) -> None:
    atomic_write_text(run_dir / "servers.json",
                      json.dumps({"servers": [{"addr": "127.0.0.1:1", "pid": pid, "state": "serving"}]}))


@pytest.fixture()
def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _trainer(seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])


@pytest.mark.parametrize("grace", [0.0, 2.0])
def test_all_servers_dead_fails_after_the_grace_period(tmp_path: Path, dead_pid: int, grace: float) -> None:
    _registry(tmp_path, dead_pid)
    proc = _trainer(60)
    t0 = time.monotonic()
    try:
        with pytest.raises(LaunchError, match="all rollout servers died"):
            supervise(proc, tmp_path / "metrics.jsonl", 10, [], True, run_dir=tmp_path, revive_grace_s=grace)
    finally:
        proc.kill()
        proc.wait()
    waited = time.monotonic() - t0
    assert grace <= waited < grace + 3.0


def test_a_replacement_within_the_grace_period_keeps_the_run(tmp_path: Path, dead_pid: int) -> None:
    _registry(tmp_path, dead_pid)
    live = _trainer(60)  # stands in for the replacement server
    proc = _trainer(4)  # the trainer finishes normally
    threading.Timer(1.0, _registry, (tmp_path, live.pid)).start()
    try:
        rc = supervise(proc, tmp_path / "metrics.jsonl", 10, [], True, run_dir=tmp_path, revive_grace_s=3.0)
    finally:
        for p in (proc, live):
            p.kill()
            p.wait()
    assert rc == 0
