"""Sim-to-live decision agreement (evaluation/decisions.py, evaluation/live_ab.py's "decisions"): the simulator's
decision log comes from the one LibraController the live run uses, the comparison pairs first plans and moves
within the step tolerance, and (slow) a real emulated run next to the simulator's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areal_libra.sim.libra import control_config, plan_for, profile_history
from areal_libra.sim.report import make_env
from evaluation.decisions import compare, layout, main, read_events, run_sim_libra, write_events


def test_the_simulators_log_is_its_controllers_decisions(tmp_path: Path, monkeypatch) -> None:
    # A trace whose lengths grow (the first 20 steps of `synth_trace --growth 4 --steps 60`) re-plans on 48
    # A800s, Search-R1 on 16 releases and joins (tests/control/test_controller.py's runs). Under AReaL's
    # consumption rule: Libra's lag bound (on by default) slows these 20 steps and its step-10 decision keeps
    # the plan (over 60 steps it re-plans once, docs/simulator.md); this test is about the log, not the bound.
    import areal_libra.sim.libra as sim_libra
    from evaluation.synth_trace import main as synth_main

    monkeypatch.setattr(sim_libra, "BOUND_LAG", False)

    assert synth_main(["--out", str(tmp_path / "growth"), "--steps", "20", "--seed", "0",
                       "--set", "gen_drift=0.019", "--set", "calls_drift=0.019"]) == 0
    env = make_env(str(tmp_path / "growth"), "a800x48", "qwen3-14b", 0)
    first = plan_for(env, profile_history(env.workload.profile(env.profile_groups)), False)
    res, events = run_sim_libra(env, 20)
    assert events[0]["event"] == "initial_plan" and events[0]["step"] == 0
    assert layout(events[0]) == (first.rollout_alloc().split(":")[1], first.train_alloc().split(":")[1])
    replans = [e for e in events if e["event"] == "replan"]
    assert replans and res["reconfigurations"] >= len(replans)
    assert all(None not in layout(e) for e in replans)  # each re-plan names the layout it moved to
    # The log round-trips through the live run's format.
    path = write_events(tmp_path / "sim_control_events.jsonl", events)
    assert [(e["step"], e["event"]) for e in read_events(path)] == [(e["step"], e["event"]) for e in events]
    env = make_env("search_r1", "a800x16", "qwen3-14b", 0)
    kinds = [e["event"] for e in run_sim_libra(env, 25)[1]]
    assert "release" in kinds and "join" in kinds


def _plan(step: int, rollout: str, train: str) -> dict:
    return {"step": step, "event": "initial_plan", "detail": f"train:   megatron:{train}  micro-batch 1\n"
            f"rollout: sglang:{rollout}  T_rollout 1.00 s"}


def _replan(step: int, rollout: str, train: str) -> dict:
    return {"step": step, "event": "replan", "detail": f"(periodic): embedded:{rollout} train megatron:{train} "
            "(measured 9.0s -> predicted 7.0s)"}


def _move(step: int, kind: str) -> dict:
    return {"step": step, "event": kind, "detail": f"1: {kind}"}


def test_compare_pairs_decisions_within_the_tolerance() -> None:
    sim = [_plan(0, "d1t1+d2t4", "d7t1p1"), _move(4, "kept"), _replan(10, "d4t2", "d8t1p1"), _move(14, "release")]
    live = [_plan(1, "d1t1+d2t4", "d7t1p1"), _replan(12, "d4t2", "d8t1p1"), _move(13, "release")]
    out = compare(sim, live)
    assert out["agree"] and out["first_plan"]["same"] and len(out["moves"]) == 2
    assert out["kept"] == {"sim": [4], "live": []}
    # Three steps apart, another kind, a move missing, another first plan or re-plan layout: no agreement.
    assert not compare(sim, [*live[:2], _move(17, "release")])["agree"]
    assert not compare(sim, [*live[:2], _move(13, "join")])["agree"]
    assert not compare(sim, live[:2])["agree"]
    assert not compare(sim, [_plan(1, "d2t4", "d8t1p1"), *live[1:]])["agree"]
    assert not compare(sim, [live[0], _replan(12, "d8t1", "d8t1p1"), live[2]])["agree"]
    assert compare(sim, [*live[:2], _move(17, "release")], tolerance=3)["agree"]


def test_the_command_compares_two_logs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    a = write_events(tmp_path / "sim.jsonl", [_plan(0, "d2t4", "d8t1p1"), _move(6, "join")])
    b = write_events(tmp_path / "live.jsonl", [_plan(1, "d2t4", "d8t1p1"), _move(7, "join")])
    assert main([str(a), str(b), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["agree"] is True
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    assert main([str(a), str(tmp_path / "bad.jsonl")]) == 2
    assert main([str(a), str(tmp_path / "missing.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") for line in err)


def test_the_live_run_takes_the_simulators_control_settings() -> None:
    from areal_libra.config import libra_config
    from areal_libra.sim.systems import SimKnobs
    from evaluation.live_ab import control_overrides

    sim = control_config(SimKnobs())
    over = control_overrides(sim)
    tree: dict = {}
    for o in over:
        key, val = o.removeprefix("libra.control.").split("=", 1)
        node = tree
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = json.loads(val) if val[0] in "[0123456789tf" else val
    live = libra_config({"control": tree}).control
    for f in ("replan_policy", "elastic_policy", "calibrate", "settle_steps", "elastic_persist", "warmup_steps"):
        assert getattr(live, f) == getattr(sim, f), f
    assert list(live.allowed_tp) == [1, 2, 4, 8]


@pytest.mark.slow
def test_a_live_emulated_run_next_to_the_simulator(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from evaluation.live_ab import main as live_ab

    rc = live_ab(["--workload", "search_r1", "--accelerators", "16", "--gpu", "h200", "--model", "qwen3-14b",
                  "--batch-prompts", "8", "--group-size", "8", "--seed", "0", "--steps", "4", "--time-scale", "0.25", "--json",
                  "--modes", "libra", "--fileroot", str(tmp_path)])  # the decisions are libra's: no static run
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    d = res["decisions"]
    assert d["sim"][0]["event"] == "initial_plan" and d["sim"][0]["step"] == 0
    # The live run's first plan before step 1, on its profiling pass (as many groups as the simulator's, all of
    # them finished: control.profile), from its own control_events.jsonl; the simulator's log written next to it.
    assert [(e["step"], e["event"]) for e in d["live"][:2]] == [(0, "profile"), (0, "initial_plan")]
    assert d["live"][0]["detail"].startswith("128 of 128 trajectories (16 groups x 8)")
    assert d["first_plan"]["same"]  # the same procedure on the same draws: the same first plan
    (live_log,) = tmp_path.rglob("ab-libra/control_events.jsonl")
    assert (live_log.parent / "sim_control_events.jsonl").exists()
    assert [e["step"] for e in read_events(live_log)] == [e["step"] for e in d["live"]]
    assert d["first_plan"]["live"]["layout"][0] and d["first_plan"]["sim"]["layout"][0]
    assert isinstance(d["agree"], bool)
    assert d["agree"] == compare(d["sim"], d["live"])["agree"]
