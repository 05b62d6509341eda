"""End to end: `python -m areal_libra.launch experiment=dapo_math cluster=cpu_hetero` runs GRPO with two
embedded server groups and C-MLFQ dispatch and survives losing a server mid-run: the short group's only
server is SIGKILLed, its requests move to the long group, and every step still trains on a full batch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a 3-step training run: ~1.5 minutes on 2 shared cores


def _server_pid(port: str) -> int:
    out = subprocess.run(["pgrep", "-f", f"embedded_server.*--port {port}"], capture_output=True, text=True)
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 1, out.stdout
    return pids[0]


def test_cpu_hetero_run_finishes_after_losing_a_server(tmp_path: Path) -> None:
    steps, kill_after = 3, 1
    proc = subprocess.Popen(
        # The static groups (libra.mode=static): this checks failover between fixed groups; libra mode's
        # live layout changes are tested in test_e2e_launch.py and tests/rollout/test_fleet.py.
        [sys.executable, "-m", "areal_libra.launch", "experiment=dapo_math", "cluster=cpu_hetero", "libra.mode=static",
         f"total_train_steps={steps}", f"cluster.fileroot={tmp_path}", "trial_name=hetero"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run = tmp_path / "logs" / os.environ.get("USER", "root") / "dapo-math" / "hetero"
    killed = None
    try:
        deadline = time.monotonic() + 900
        while proc.poll() is None and time.monotonic() < deadline:
            mpath = next(tmp_path.rglob("metrics.jsonl"), None)
            if killed is None and mpath is not None and len(mpath.read_text().splitlines()) >= kill_after:
                run = mpath.parent
                groups = json.loads((run / "rollout_groups.json").read_text())["groups"]
                killed = groups[0]["addresses"][0]  # the short group's only server: most requests go there
                os.kill(_server_pid(killed.rsplit(":", 1)[1]), signal.SIGKILL)
            time.sleep(0.5)
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert killed is not None, "the run ended before the server could be killed"
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, steps + 1))
    assert recs[0]["cmlfq/requests/short"] > 0  # before the loss the short group served
    # after it every step still trained on a full batch, served by the long group (fall-through)
    # (`trajectories` counts episodes that finished during the step, which asynchrony shifts between steps)
    assert all(r["ppo_actor/n_seqs"] == 128 for r in recs)
    assert sum(r["cmlfq/health_down"] for r in recs) == 1 and recs[-1]["cmlfq/unhealthy_servers"] == 1
    assert recs[-1]["cmlfq/requests/short"] == 0 and recs[-1]["cmlfq/requests/long"] > 0
    events = [json.loads(x) for x in (run / "dispatch_health.jsonl").read_text().splitlines()]
    assert [(e["addr"], e["up"]) for e in events] == [(killed, False)]
    # the live tree was saved in the run directory
    assert (run / "cmlfq_tree.bin").is_file() and (run / "cmlfq_window.jsonl").is_file()
