"""evaluation/throughput.py and evaluation/ablation.py: pinned keys, figures, bad input."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KEYS = {"tokens_per_s", "mean_step_s", "rollout_busy_frac", "train_busy_frac", "reconfigurations",
        "elastic_moves"}


def _run(script, *args):
    return subprocess.run([sys.executable, "-m", f"evaluation.{script.removesuffix('.py')}", *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_throughput_json_keys_and_plot(tmp_path):
    png = tmp_path / "t.png"
    p = _run("throughput.py", "--workload", "search_r1", "--cluster", "a800x16", "--model", "qwen3-14b",
             "--steps", "3", "--json", "--batch-prompts", "4", "--systems", "verl_colocated", "verl_static_uniform",
             "libra", "--plot", str(png))
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["workload"] == "search_r1"
    assert set(out["systems"]) == {"verl_colocated", "verl_static_uniform", "libra"}
    for r in out["systems"].values():
        assert KEYS <= set(r)
        assert r["tokens_per_s"] > 0 and 0 <= r["rollout_busy_frac"] <= 1 and 0 <= r["train_busy_frac"] <= 1
        # Each system as a fraction of its run's roofline bound.
        assert 0 < r["roofline_frac"] < 1
        assert r["roofline_frac"] == pytest.approx(r["tokens_per_s"] / r["roofline_tokens_per_s"])
    assert png.stat().st_size > 10_000


def test_ablation_prints_the_ladder():
    p = _run("ablation.py", "--workload", "r2e_gym", "--cluster", "a800x16", "--steps", "2", "--json",
             "--batch-prompts", "2", "--systems", "static_uniform", "+hetero_tp")
    assert p.returncode == 0, p.stderr
    assert list(json.loads(p.stdout)["systems"]) == ["static_uniform", "+hetero_tp"]


@pytest.mark.parametrize("args,msg", [
    (["--workload", "nope"], "unknown workload 'nope'"),
    (["--workload", "r2e_gym", "--cluster", "a800x4"], "smaller than one model replica"),
    (["--workload", "r2e_gym", "--systems", "bogus"], "unknown system 'bogus'"),
    (["--workload", "r2e_gym", "--model", "nomodel"], "nomodel"),
    (["--workload", "r2e_gym", "--max-concurrent-rollouts", "many"], "--max-concurrent-rollouts must be"),
])
def test_bad_input_is_one_clear_line(args, msg):
    p = _run("throughput.py", "--steps", "2", *args)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and msg in lines[0] and "Traceback" not in p.stderr


def test_malformed_trace_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"trajectory_id": "a", "prompt_id": "p", "step": 0, "prompt_tokens": 5,'
                   ' "segments": [{"gen_tokens": -3, "tool": null}]}\n')
    p = _run("throughput.py", "--workload", str(bad), "--steps", "2")
    assert p.returncode == 2
    assert "bad.jsonl:1" in p.stderr and "gen_tokens" in p.stderr and "Traceback" not in p.stderr


def test_ablation_reports_migrated_tokens_and_fallback_fraction_per_rung():
    args = ("--workload", "search_r1", "--cluster", "a800x48", "--steps", "3", "--batch-prompts", "4",
            "--systems", "+hetero_tp", "+cmlfq")
    p = _run("ablation.py", *args, "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)["systems"]
    # +hetero_tp routes least-loaded: C-MLFQ decides nothing there and nothing migrates.
    assert out["+hetero_tp"]["fallback_fraction"] is None and out["+hetero_tp"]["migrated_token_ratio"] == 0
    assert 0 <= out["+cmlfq"]["fallback_fraction"] <= 1 and out["+cmlfq"]["migrated_token_ratio"] >= 0
    text = _run("ablation.py", *args)
    assert text.returncode == 0, text.stderr
    head, hetero, cmlfq = text.stdout.splitlines()[1:4]
    assert head.split()[-2:] == ["migr", "fallbk"]
    assert hetero.split()[-1] == "-" and cmlfq.split()[-1] == f"{out['+cmlfq']['fallback_fraction']:.2f}"


def test_ablation_over_seeds_reports_each_run_and_their_mean(tmp_path, capsys):
    """--seeds runs the ladder once per seed, each run as --seed S alone would, and the mean of each rung;
    evaluation.seed_stats pools the single-seed runs' JSON into the same summary."""
    common = ("--workload", "r2e_gym", "--cluster", "a800x16", "--steps", "2", "--json", "--batch-prompts", "2",
              "--systems", "static_uniform", "+hetero_tp")
    p = _run("ablation.py", *common, "--seeds", "0", "1")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["seeds"] == [0, 1] and set(out["runs"]) == {"0", "1"}
    for seed in (0, 1):
        alone = _run("ablation.py", *common, "--seed", str(seed))
        assert alone.returncode == 0, alone.stderr
        (tmp_path / f"s{seed}.json").write_text(alone.stdout)
        ref = json.loads(alone.stdout)["systems"]
        got = out["runs"][str(seed)]["systems"]
        assert out["runs"][str(seed)]["seed"] == seed
        assert {n: r["tokens_per_s"] for n, r in got.items()} == {n: r["tokens_per_s"] for n, r in ref.items()}
    runs = [out["runs"][s]["systems"] for s in ("0", "1")]
    assert runs[0]["+hetero_tp"]["tokens_per_s"] != runs[1]["+hetero_tp"]["tokens_per_s"]  # the seeds differ
    mean = {n: (runs[0][n]["tokens_per_s"] + runs[1][n]["tokens_per_s"]) / 2 for n in runs[0]}
    for n, m in out["mean"].items():
        assert m["mean_tokens_per_s"] == pytest.approx(mean[n])
    assert out["mean"]["static_uniform"]["change_pct"] is None
    assert out["mean"]["+hetero_tp"]["change_pct"] == pytest.approx(
        100 * (mean["+hetero_tp"] / mean["static_uniform"] - 1))
    paired = out["mean"]["+hetero_tp"]["paired"]
    per = {s: 100 * (r["+hetero_tp"]["tokens_per_s"] / r["static_uniform"]["tokens_per_s"] - 1)
           for s, r in zip(("0", "1"), runs)}
    assert paired["against"] == "static_uniform" and paired["per_seed_pct"] == pytest.approx(per)
    assert paired["mean_pct"] == pytest.approx(sum(per.values()) / 2)
    assert out["mean"]["static_uniform"]["paired"] is None

    from evaluation import seed_stats

    assert seed_stats.main([str(tmp_path / "s1.json"), str(tmp_path / "s0.json"), "--json"]) == 0
    pooled = json.loads(capsys.readouterr().out)
    assert pooled["seeds"] == [0, 1]
    assert pooled["mean"] == out["mean"]  # the same figures in the same seed order: the same arithmetic


@pytest.mark.parametrize("args,msg", [
    (["--seed", "1", "--seeds", "0", "2"], "give --seed or --seeds, not both"),
    (["--seeds", "0", "0"], "--seeds lists a seed twice"),
])
def test_bad_seed_arguments_are_one_clear_line(args, msg):
    p = _run("ablation.py", "--workload", "r2e_gym", "--steps", "2", *args)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and msg in lines[0] and "Traceback" not in p.stderr


def test_seed_stats_refuses_runs_of_different_settings_or_figures(tmp_path, capsys):
    from evaluation import seed_stats

    def run(seed, tps, steps=60):
        return {"workload": "r2e_gym", "cluster": "a800x48", "model": "qwen3-14b", "steps": steps, "seed": seed,
                "batch_prompts": 128, "group_size": 16, "truth": "default", "scale": "default",
                "max_concurrent_rollouts": "0", "systems": {"a": {"tokens_per_s": 100.0}, "b": {"tokens_per_s": tps}}}

    files = {"a": run(0, 99.0), "b": run(1, 101.0, steps=40), "c": run(0, 98.0), "d": {"nothing": 1}}
    for k, doc in files.items():
        (tmp_path / f"{k}.json").write_text(json.dumps(doc))
    (tmp_path / "e.json").write_text("{not json")
    for pair, msg in [(("a", "b"), "seed 1 was run with steps=40, the first run with 60"),
                      (("a", "c"), "seed 0 appears twice with different figures"),
                      (("d",), "not the JSON of evaluation.ablation"),
                      (("e",), "not a readable JSON file")]:
        assert seed_stats.main([str(tmp_path / f"{k}.json") for k in pair]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0], err
    # The same run given twice is one seed, not two.
    assert seed_stats.main([str(tmp_path / "a.json"), str(tmp_path / "a.json"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["seeds"] == [0]
