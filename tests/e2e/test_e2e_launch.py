"""End to end: the launcher runs AReaL's GRPO trainer with embedded servers and the tool workflow."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_two_step_run_writes_metrics_and_wandb(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "areal_libra.launch", "experiment=dapo_math", "total_train_steps=2",
         f"cluster.fileroot={tmp_path}", "trial_name=e2e"],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "run directory" in r.stdout and "done; metrics in" in r.stdout
    metrics = list(tmp_path.rglob("metrics.jsonl"))
    assert len(metrics) == 1 and str(metrics[0]).startswith(str(tmp_path))
    recs = [json.loads(line) for line in metrics[0].read_text().splitlines()]
    assert [rec["step"] for rec in recs] == [1, 2]
    for rec in recs:
        for key in ("reward", "throughput_tokens_per_s", "tool_calls", "tool_failures", "gen_tokens"):
            assert key in rec, key
        assert 0.0 <= rec["reward"] <= 1.0
    assert sum(rec["gen_tokens"] for rec in recs) > 0
    assert any(rec["throughput_tokens_per_s"] > 0 for rec in recs)
    runs = list(tmp_path.rglob("offline-run-*"))
    assert runs, "no offline W&B run under the fileroot"


def test_libra_mode_replans_the_emulated_cluster_live(tmp_path: Path) -> None:
    """The default libra mode on a small emulated cluster: before step 1 the planner's first plan (on the
    profiling pass) replaces the start layout (one TP1 server on 6 emulated H200s) through a live reconfiguration; plan/* per step,
    the decision log and the allocation figure are written."""
    r = subprocess.run(
        [sys.executable, "-m", "areal_libra.launch", "experiment=dapo_math", "cluster=emulated",
         "total_train_steps=2", f"cluster.fileroot={tmp_path}", "trial_name=libra",
         "libra.emulated.accelerators=6", "libra.rollout_groups=[{name: g0, tp: 1, count: 1}]"],
        capture_output=True, text=True, timeout=900,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    run = next(tmp_path.rglob("metrics.jsonl")).parent
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [rec["step"] for rec in recs] == [1, 2]
    assert all(k in recs[-1] for k in ("plan/replans", "plan/rollout_gpus", "plan/train_gpus", "plan/reconfig_s",
                                        "plan/predicted_vs_measured_step", "emul/train_target_s"))
    assert "libra/admission_held_polls" in recs[-1]  # the working-set admission gates AReaL's executor (patch 17)
    events = [json.loads(line) for line in (run / "control_events.jsonl").read_text().splitlines()]
    # The profiling pass before step 1, then the first plan solved on it (control.profile), both at step 0.
    assert [(e["step"], e["event"]) for e in events[:2]] == [(0, "profile"), (0, "initial_plan")]
    assert recs[-1]["plan/reconfigurations"] == 1.0 and recs[0]["plan/reconfig_s"] > 0
    assert recs[-1]["plan/rollout_gpus"] + recs[-1]["plan/train_gpus"] == 6
    assert recs[-1]["plan/allocation"] != "rollout 1xTP1"
    assert (run / "allocation.png").stat().st_size > 1000
    assert (run / "fleet.jsonl").exists()
