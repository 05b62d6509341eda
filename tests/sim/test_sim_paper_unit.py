"""Issue 25: the Libra paper's unit (input + output tokens of the trained trajectories per second, whole cluster),
the --truth profile flag, and the growth table command."""

import json
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from areal_libra.sim.hardware import PAPER_LEVEL, SGLANG, TRUTH_PROFILES, truth_constants, truth_for
from areal_libra.sim.report import make_env, run_many
from areal_libra.trace import Segment, ToolReturn, Trajectory, write_traces

ROOT = Path(__file__).resolve().parents[2]
PROMPT, GEN, PAYLOAD = 300, 120, 50  # per trajectory: two turns of 60 generated tokens around one tool call


def _trace(path: Path, prompts: int = 6, samples: int = 4) -> Path:
    trajs = [Trajectory(f"t{p}-{k}", f"p{p}", 0, PROMPT,
                        (Segment(60, ToolReturn("bash", PAYLOAD, "success", 0.5)), Segment(60, None)))
             for p in range(prompts) for k in range(samples)]
    write_traces(path, trajs)
    return path


def test_paper_unit_of_a_tiny_known_run(tmp_path):
    env = make_env(str(_trace(tmp_path / "t.jsonl")), "a800x16", "qwen3-14b", seed=0, batch_prompts=2)
    steps = 3
    res, sims = run_many(["static_uniform"], env, steps)
    r, sim = res["static_uniform"], sims["static_uniform"]
    per_step = 2 * 4  # 2 prompts x 4 samples trained per step
    wall = sim.records[-1]["t_end"]
    # Generated tokens only (today's unit) vs prompt + generated (the paper's); tool payloads count in neither.
    assert r["tokens_per_s"] * wall == pytest.approx(steps * per_step * GEN)
    assert r["paper_tokens_per_s"] * wall == pytest.approx(steps * per_step * (PROMPT + GEN))
    assert r["paper_tokens_per_s"] / r["tokens_per_s"] == pytest.approx((PROMPT + GEN) / GEN)
    # Libra's analysis script averages each step's rate: tokens of the step over the step's wall time.
    rates = [per_step * (PROMPT + GEN) / rec["interval_s"] for rec in sim.records]
    assert r["paper_tokens_per_s_step_mean"] == pytest.approx(sum(rates) / len(rates))


def test_default_profile_is_the_grounded_truth_and_paper_level_differs():
    assert TRUTH_PROFILES["default"] == SGLANG
    assert truth_constants("default") == SGLANG
    # Every field paper-level changes is listed in docs/simulator.md; the new fields' defaults keep the truth.
    changed = {f.name for f in fields(SGLANG) if getattr(SGLANG, f.name) != getattr(PAPER_LEVEL, f.name)}
    doc = (ROOT / "docs" / "simulator.md").read_text()
    for name in changed:
        assert f"`{name}`" in doc, name
    assert SGLANG.max_in_flight == 0 and SGLANG.tool_latency_scale == 1.0 and SGLANG.train_passes == 8.0
    d, p = truth_for("a800", "qwen3-14b"), truth_for("a800", "qwen3-14b", PAPER_LEVEL)
    lens = [8000] * 64
    assert p.train_step_s(lens, 8, 1, 4) > 1.5 * d.train_step_s(lens, 8, 1, 4)
    assert p.weight_sync_s(8) > d.weight_sync_s(8) + 20
    with pytest.raises(ValueError, match="unknown truth profile"):
        truth_constants("nope")


def test_in_flight_limit_bounds_running_trajectories(tmp_path):
    from dataclasses import replace

    TRUTH_PROFILES["_test_cap"] = replace(SGLANG, max_in_flight=4)
    try:
        env = make_env(str(_trace(tmp_path / "t.jsonl")), "a800x16", "qwen3-14b", seed=0, batch_prompts=2,
                       truth="_test_cap")
        free = make_env(str(_trace(tmp_path / "u.jsonl")), "a800x16", "qwen3-14b", seed=0, batch_prompts=2)
        capped, sims = run_many(["static_uniform"], env, 3)
        uncapped, _ = run_many(["static_uniform"], free, 3)
    finally:
        del TRUTH_PROFILES["_test_cap"]
    sim = sims["static_uniform"]
    assert sim.in_flight <= 4 + 4  # a group (4 samples) starts while fewer than 4 run
    assert capped["static_uniform"]["mean_step_s"] > uncapped["static_uniform"]["mean_step_s"]


def _run(module, *args):
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)


def test_truth_flag_selects_the_profile_in_the_cli():
    base = ["--workload", "r2e_gym", "--cluster", "a800x16", "--steps", "2", "--json", "--batch-prompts", "2",
            "--systems", "static_uniform"]
    a, b = _run("evaluation.ablation", *base), _run("evaluation.ablation", *base, "--truth", "paper-level")
    assert a.returncode == 0 and b.returncode == 0, (a.stderr, b.stderr)
    ja, jb = json.loads(a.stdout), json.loads(b.stdout)
    assert ja["truth"] == "default" and jb["truth"] == "paper-level"
    ra, rb = ja["systems"]["static_uniform"], jb["systems"]["static_uniform"]
    assert rb["paper_tokens_per_s"] < ra["paper_tokens_per_s"] / 2
    bad = _run("evaluation.throughput", *base[:-2], "--truth", "fast")
    assert bad.returncode == 2 and "invalid choice: 'fast'" in bad.stderr


def test_growth_command_holds_its_claims():
    p = _run("evaluation.growth", "--json")
    assert p.returncode == 0, p.stderr
    g = json.loads(p.stdout)
    rows = {r["length"]: r for r in g["rows"]}
    assert rows[1024]["batch"]["trajectories"] == 2048 and rows[32768]["tokens"]["trajectories"] == 64
    assert rows[32768]["batch"]["kv_binds"] and not rows[1024]["batch"]["kv_binds"]
    # Decode grows faster than training with length, whichever quantity is held fixed.
    for mode in ("batch", "tokens"):
        assert g["ratios"][mode]["rollout"] > 2 * g["ratios"][mode]["train"]
    bad = _run("evaluation.growth", "--rollout-gpus", "40", "--train-gpus", "32")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_paper_tables_renders_costs_and_a_regime_map():
    from evaluation.paper_tables import cost_lines, regime_lines

    costs = "\n".join(cost_lines())
    assert "`default`" in costs and "`paper-level`" in costs
    sync = next(line for line in costs.splitlines() if line.startswith("| weight sync"))
    default_s, paper_s = (float(x) for x in sync.strip("| ").split(" | ")[1:])
    assert paper_s > 10 * default_s
    lines = regime_lines(str(ROOT / "docs" / "regimes_paper_level.json"))
    assert lines[0].startswith("truth `paper-level`")
    rows = [line for line in lines if line.startswith("| base |")]
    assert len(rows) == 1 and "(" in rows[0]  # both units in each cell


def test_paper_tables_marks_a_system_a_kept_run_lacks():
    from evaluation.paper_tables import table

    r = {"tokens_per_s": 1000.0, "paper_tokens_per_s": 2500.0}
    runs = {"search_r1": {"systems": {"libra": r, "static_libra_loop": r}}, "r2e_gym": {"systems": {"libra": r}}}
    lines = table("system", ["static_libra_loop", "libra"], runs)
    assert lines[2] == "| static_libra_loop | 1,000 (2,500) | — |"
    assert lines[3] == "| libra | 1,000 (2,500) | 1,000 (2,500) |"
