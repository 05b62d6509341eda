"""Patch 14 (consumption rule) on AReaL's real dispatcher: with Libra's rule installed the trainer's batch
for version k holds every group that started at version <= k - eta (it waits for a straggler there), and
without it AReaL's rule is unchanged (the first finished groups). Patch 15 puts the request priority the
router set into SGLang's payload. Patch 17's admission gate holds tasks back while it is closed."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from areal_libra import patches

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


@pytest.fixture(scope="module")
def child(tmp_path_factory) -> dict:
    """The child's results on a copy of the installed AReaL with every project patch applied (the installed
    one is left alone)."""
    root = tmp_path_factory.mktemp("areal")
    src = Path(patches.find_areal_root(None)) / "areal"
    shutil.copytree(src, root / "areal", ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run([sys.executable, "-m", "areal_libra.patches", "apply", "--areal-dir", str(root)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(ROOT)]))
    r = subprocess.run([sys.executable, str(HERE / "_consumption_child.py")], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_rule_waits_for_the_group_at_the_bound(child: dict) -> None:
    out = child["rule"]
    assert out["first"] == ["b", "c"]
    # version 1, eta 1: "slow" (version 0) would be 2 versions old next step, so it is in this batch, with the
    # oldest finished group; the trainer waited for it
    assert out["second"] == ["d", "slow"]
    assert out["wait_s"] > 1.0


def test_without_the_rule_areal_takes_the_first_finished(child: dict) -> None:
    out = child["areal"]
    assert out["first"] == ["b", "c"]
    assert "slow" not in out["second"] and out["wait_s"] < 1.0


def test_payload_carries_the_routers_priority(child: dict) -> None:
    assert child["payload"] == [3, False]


def test_a_closed_admission_gate_holds_every_task_back(child: dict) -> None:
    out = child["gate"]
    assert out["while_closed"] == []  # the staleness bound alone would have started all four
    assert out["after_open"] == ["a", "b", "c", "d"] and out["open_s"] < 5.0
