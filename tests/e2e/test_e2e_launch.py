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
