"""python -m areal_libra.whatif: plan, static vs Libra, the main reason; bad input exits 2 with one line."""

import json
import random
import subprocess
import sys

import pytest

from areal_libra.trace import Segment, ToolReturn, Trajectory, write_traces
from areal_libra.whatif import main_reason


def _trace(path, n_prompts=12, group=4):
    rng = random.Random(0)
    out = []
    for p in range(n_prompts):
        for k in range(group):
            segs = tuple(Segment(rng.randrange(200, 2000), ToolReturn("search", 300, "success", 1.0))
                         for _ in range(rng.randrange(1, 4))) + (Segment(rng.randrange(100, 800), None),)
            out.append(Trajectory(f"p{p}-{k}", f"p{p}", 0, 500, segs))
    write_traces(path, out)


def _run(*args):
    return subprocess.run([sys.executable, "-m", "areal_libra.whatif", *args], capture_output=True, text=True,
                          timeout=120)


def test_whatif_prints_plan_throughputs_and_reason(tmp_path):
    tr = tmp_path / "my.jsonl"
    _trace(tr)
    p = _run("--trace", str(tr), "--cluster", "a800x16", "--model", "qwen3-14b", "--steps", "3", "--json",
             "--batch-prompts", "4")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    s, lb = r["areal_static_optimal"], r["libra"]
    assert r["libra_over_static"] == pytest.approx(lb["tokens_per_s"] / s["tokens_per_s"])
    assert 0 < s["roofline_frac"] < 1 and 0 < lb["roofline_frac"] < 1
    assert "training" in r["plan"]["summary"] and r["reason"]
    text = _run("--trace", str(tr), "--cluster", "a800x16", "--steps", "3", "--batch-prompts", "4")
    assert text.returncode == 0 and "main reason:" in text.stdout and "libra / static" in text.stdout


@pytest.mark.parametrize("args, word", [
    (["--trace", "/nonexistent.jsonl"], "no such trace"),
    (["--trace", "TRACE", "--cluster", "zz9x4"], "zz9"),
    (["--trace", "TRACE", "--steps", "1"], "--steps"),
    (["--trace", "BAD"], "BAD"),
    ([], "--trace"),
])
def test_bad_input_one_line_exit_2(tmp_path, args, word):
    good, bad = tmp_path / "t.jsonl", tmp_path / "bad.jsonl"
    _trace(good, 2, 2)
    bad.write_text('{"not": "a trajectory"}\n')
    args = [str(good) if a == "TRACE" else str(bad) if a == "BAD" else a for a in args]
    word = str(bad) if word == "BAD" else word
    p = _run(*args)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and word in lines[0] and "Traceback" not in p.stderr


def _res(tps, train, roll, step=10.0, split="train 8 / rollout 8 GPUs"):
    return {"tokens_per_s": tps, "train_busy_frac": train, "rollout_busy_frac": roll, "mean_step_s": step,
            "split": split, "reconfigurations": 0, "roofline_frac": 0.5}


def test_main_reason_names_the_bottleneck():
    # Static leaves its training GPUs idle while rollout is saturated: Libra's gain is the rebalance.
    up = main_reason(_res(100, 0.5, 0.99), _res(130, 0.9, 0.95), plan_step_s=8.0)
    assert up.startswith("AReaL-Static-Optimal is rollout-bound") and "50%" in up
    down = main_reason(_res(100, 0.9, 0.9), _res(80, 0.97, 0.6, step=12.0), plan_step_s=8.0)
    assert "training-bound" in down and "+50%" in down
    level = main_reason(_res(100, 0.9, 0.9), _res(101, 0.9, 0.9), plan_step_s=8.0)
    assert level.startswith("level")
    short = main_reason(_res(100, 0.5, 0.5, step=5.0), _res(90, 0.5, 0.5, step=5.5), 3.0, fixed_step_s=3.0)
    assert short.startswith("steps are short")


def test_throughput_replays_a_trace_file_under_libra_without_group_size(tmp_path):
    """A live run's trace replays through the simulator's Libra as is: the group size is the trace's own
    (it used to fail with 'global batch must be >= 1, got 0' unless --group-size was given)."""
    trace = tmp_path / "t.jsonl"
    _trace(trace, group=4)
    p = subprocess.run([sys.executable, "-m", "evaluation.throughput", "--workload", str(trace), "--cluster",
                        "a800x16", "--model", "qwen3-14b", "--steps", "3", "--batch-prompts", "4", "--systems",
                        "libra", "--json"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["systems"]["libra"]["tokens_per_s"] > 0
