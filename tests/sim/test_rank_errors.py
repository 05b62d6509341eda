"""evaluation.rank_errors: the calibrated evaluator's prediction against each sweep candidate's measurement."""

import json
import subprocess
import sys

import pytest

from evaluation.rank_errors import relative_errors, table


def _run(pred):
    cands = [{"rollout_gpus": g, "tp": tp, "train": {"gpus": 48 - g}, "tokens_per_s": tps}
             for g, tp, tps in ((8, 1, 100.0), (8, 4, 200.0), (16, 1, 400.0))]
    return {"systems": {"libra": {"ranking": {"last_predicted_step_s": pred}}}, "baseline_candidates": cands}


def test_rel_is_predicted_over_measured_up_to_the_median():
    # predicted x measured tokens/s: 1,000, 1,000, 2,000 -> the third predicted twice as slow as it measured
    rows = relative_errors(_run([10.0, 5.0, 5.0]))
    assert [r["rel"] for r in rows] == [1.0, 1.0, 2.0]
    assert [(r["rollout_gpus"], r["tp"], r["train_gpus"]) for r in rows] == [(8, 1, 40), (8, 4, 40), (16, 1, 32)]
    lines = table(rows).splitlines()
    assert lines[0].split("|")[2:] == [" TP1 ", " TP4"] and lines[2].split("|")[2:] == [" 2.00 ", "   - "]


def test_a_run_without_a_ranking_is_one_line_and_exit_2(tmp_path):
    with pytest.raises(ValueError, match="no ranking"):
        relative_errors(_run([1.0]))
    f = tmp_path / "run.json"
    f.write_text(json.dumps({"systems": {"areal_static_optimal": {}}}))
    p = subprocess.run([sys.executable, "-m", "evaluation.rank_errors", str(f)], capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "no system 'libra'" in p.stderr


def test_the_oracle_removes_an_error_that_follows_the_tp():
    from evaluation.rank_errors import oracle_spearman

    # Four rollout sizes x TP1/TP4, all with training GPUs to spare; the evaluator prices every TP4 candidate
    # at half its true step time, which scrambles the ranking until the TP's error is divided out.
    cands, pred = [], []
    for g in (8, 16, 24, 32):
        for tp, speed in ((1, 1.0), (4, 1.2)):
            tokens = 100.0 * g * speed
            cands.append({"rollout_gpus": g, "tp": tp, "train": {"gpus": 48}, "tokens_per_s": tokens})
            pred.append(1e5 / tokens * (0.5 if tp == 4 else 1.0))
    run = {"systems": {"libra": {"ranking": {"last_predicted_step_s": pred}}}, "baseline_candidates": cands}
    sp = oracle_spearman(relative_errors(run))
    assert sp["as_predicted"] < 0.9 and sp["tp_error_removed"] == 1.0
