"""evaluation/live_elastic.py reads a finished run: events, the policy's per-step view, and whether a join was
followed by a release; bad input is one line and exit 2."""

from __future__ import annotations

import json

import pytest

from evaluation import live_elastic


def _run_dir(tmp_path, events):
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"step": 3, "step_time_s": 5.0, "plan/obs_train_s": 4.0, "plan/obs_rollout_s": 1.0,
         "elastic/t_train_s": 3.0, "elastic/t_rollout_s": 3.0, "emul/train_accelerators": 4.0},
        {"step": 4, "step_time_s": 6.0, "elastic/t_train_s": 3.0, "elastic/t_rollout_s": 6.0},
    ]) + "\n")
    (tmp_path / "control_events.jsonl").write_text("".join(
        json.dumps({"step": s, "event": k, "detail": "d"}) + "\n" for s, k in events))
    return tmp_path


def test_summary_reads_the_controllers_view_and_the_order_of_moves(tmp_path):
    out = live_elastic.summarize(_run_dir(tmp_path, [(1, "initial_plan"), (4, "join"), (23, "release")]))
    assert out["joins"] == 1 and out["releases"] == 1 and out["shows_join_and_release"]
    first, second = out["steps"]
    assert first["ratio"] == 4.0 and first["train_accelerators"] == 4.0  # the controller's view wins
    assert second["ratio"] == 0.5  # else the pool's
    assert not live_elastic.summarize(_run_dir(tmp_path, [(4, "release"), (9, "join")]))["shows_join_and_release"]
    assert not live_elastic.summarize(_run_dir(tmp_path, [(4, "join")]))["shows_join_and_release"]


@pytest.mark.parametrize("args", [["--steps", "0"], ["--set", "nokey"], ["--run-dir", "/nonexistent/run"]])
def test_bad_input_is_one_line_and_exit_2(args, capsys):
    assert live_elastic.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error:"), err
