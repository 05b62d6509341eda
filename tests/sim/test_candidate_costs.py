"""evaluation.candidate_costs: a static candidate's measured costs beside the Cost Evaluator's terms."""

import json

import pytest

from evaluation import candidate_costs as cc

SMALL = ["--workload", "search_r1", "--cluster", "a800x16", "--batch-prompts", "16", "--group-size", "4"]


def test_a_candidate_measured_under_each_loop(capsys):
    assert cc.main(SMALL + ["--candidates", "8x2", "--json"]) == 0
    areal = json.loads(capsys.readouterr().out)["candidates"]
    assert cc.main(SMALL + ["--candidates", "8x2", "--loop", "libra", "--json"]) == 0
    libra = json.loads(capsys.readouterr().out)["candidates"]
    for rows, loop in ((areal, "areal"), (libra, "libra")):
        (r,) = rows
        assert (r["rollout_gpus"], r["tp"], r["loop"]) == (8, 2, loop) and r["train"]["gpus"] == 8
        assert r["train_s"] <= r["step_s"] and r["wait_s"] <= r["step_s"]
        assert r["prefill_per_final_token"] > 0 and 0 < r["rollout_busy"] <= 1.0 + 1e-9
        # the evaluator's training term and the simulated trainer agree at the trained tokens (1.04 when written)
        assert 0.8 < r["model_over_measured_train"] < 1.25


@pytest.mark.parametrize("cand, msg", [("8by2", "is not ROLLOUT_GPUSxTP"), ("8x3", "is not one of the sweep")])
def test_bad_candidates_get_one_line(capsys, cand, msg):
    assert cc.main(SMALL + ["--candidates", cand]) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1
