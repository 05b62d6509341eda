"""Recover helpers (areal_libra.live.recover): the recovered step from AReaL's step_info.json, the
metrics kept up to it, the control history saved and reloaded, and the trial's name_resolve cleared.
The end-to-end kill-and-resume run is `python -m evaluation.recover` (minutes)."""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import OmegaConf

from areal_libra.live.recover import (
    clear_name_resolve,
    recovered_steps,
    reset_step_records,
    restore_control_state,
    save_control_state,
    trim_step_records,
)


def _cfg(root: Path, mode: str = "auto"):
    return OmegaConf.create({
        "experiment_name": "exp", "trial_name": "t",
        "recover": {"mode": mode, "fileroot": str(root), "experiment_name": "exp", "trial_name": "t"},
        "cluster": {"name_resolve": {"type": "nfs", "nfs_record_root": str(root / "nr")}},
    })


def test_recovered_steps_reads_aReaL_step_info(tmp_path: Path) -> None:
    import getpass

    cfg = _cfg(tmp_path)
    assert recovered_steps(cfg) is None  # no checkpoint yet
    d = tmp_path / "checkpoints" / getpass.getuser() / "exp" / "t" / "recover_info"
    d.mkdir(parents=True)
    (d / "step_info.json").write_text(json.dumps({"epoch": 0, "epoch_step": 5, "global_step": 5}))
    assert recovered_steps(cfg) == 6
    assert recovered_steps(_cfg(tmp_path, "disabled")) is None  # recover off: a fresh run
    (d / "step_info.json").write_text("{cut")
    assert recovered_steps(cfg) is None


def test_trim_step_records_keeps_steps_up_to_the_checkpoint(tmp_path: Path) -> None:
    p = tmp_path / "metrics.jsonl"
    p.write_text("".join(json.dumps({"step": s, "reward": s / 10}) + "\n" for s in range(1, 9)) + '{"step": 9, "rew')
    assert trim_step_records(p, 6) == 6
    assert [json.loads(x)["step"] for x in p.read_text().splitlines()] == [1, 2, 3, 4, 5, 6]
    assert trim_step_records(tmp_path / "none.jsonl", 3) == 0


def test_a_resume_trims_metrics_and_control_events_and_a_fresh_run_clears_them(tmp_path: Path) -> None:
    for name, n in (("metrics.jsonl", 9), ("control_events.jsonl", 4)):
        (tmp_path / name).write_text("".join(json.dumps({"step": 3 * s - 2, "event": "x"}) + "\n"
                                             for s in range(1, n + 1)))
    # control events at steps 1, 4, 7, 10: those after the step-6 checkpoint are decided again
    assert reset_step_records(tmp_path, 6) == "metrics.jsonl keeps 2, control_events.jsonl keeps 2"
    steps = [json.loads(x)["step"] for x in (tmp_path / "control_events.jsonl").read_text().splitlines()]
    assert steps == [1, 4]
    assert reset_step_records(tmp_path, None) == ""
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "control_events.jsonl").exists()


def test_control_history_roundtrip(tmp_path: Path) -> None:
    from areal_libra.live.live_cluster import LiveCluster
    from areal_libra.trace import Segment, Trajectory

    def traj(prompt: int, gen: int, version: int) -> Trajectory:
        return Trajectory(f"t{prompt}", "p", version, prompt, (Segment(gen),))

    a = LiveCluster(None, history_len=2000)
    for p, g, v in ((10, 30, 0), (12, 78, 1), (11, 5, 1), (9, 1, 2)):
        a.on_trajectory(traj(p, g, v))
    a.running_fn = lambda: 1  # a group of version 1 still runs: only version 0 is a complete cohort
    assert a.history(100) == [(10, 40)]
    save_control_state(tmp_path, 7, a)
    b = LiveCluster(None, history_len=2000)
    assert restore_control_state(tmp_path, b) == 4
    assert list(b.finished) == [(10, 40), (12, 90), (11, 16), (9, 10)]
    b.running_fn = lambda: 1
    assert b.history(100) == [(10, 40)]  # the versions came back: the running cohort stays out
    b.running_fn = lambda: None
    assert b.history(100) == [(10, 40), (12, 90), (11, 16), (9, 10)]
    (tmp_path / "control_state.json").write_text("not json")
    assert restore_control_state(tmp_path, b) == 0  # unreadable: nothing restored, no crash


def test_clear_name_resolve_removes_the_trials_records(tmp_path: Path) -> None:
    from areal.utils import name_resolve, names

    cfg = _cfg(tmp_path)
    name_resolve.reconfigure(cfg.cluster.name_resolve)
    # records a SIGKILLed trainer leaves on disk (it never ran its exit clean-up)
    key = names.update_weights_from_disk("exp", "t", 0)
    name_resolve.add(key, "1", delete_on_exit=False)
    other = names.update_weights_from_disk("exp", "other", 0)
    name_resolve.add(other, "1", delete_on_exit=False)
    clear_name_resolve(cfg)
    name_resolve.add(key, "2")  # would raise NameEntryExistsError had the stale record stayed
    assert name_resolve.get(other) == "1"  # another trial's records are left alone


# -- the controller's and the elastic pool's state (control_state.json snapshots) ------------------------------
def _plan(tp: int = 1, count: int = 2):
    from areal_libra.cost.training import TrainParallel
    from areal_libra.planner.types import Plan, RolloutInstance

    return Plan(train=TrainParallel(1, 1, 1), rollout_gpus=tp * count, instances=[RolloutInstance(tp, count, 4096)],
                t_train_s=1.0, t_rollout_s=1.5, makespan_s=2.5, solve_s=0.0, train_backend="fsdp")


class _Source:
    def solve(self, history):
        return _plan()

    def price(self, plan, history):
        return plan.makespan_s


def _control(tmp_path: Path):
    from areal_libra.control import ControlConfig
    from areal_libra.live.live_cluster import LiveCluster, LiveControl
    from areal_libra.rollout.groups import RolloutGroup

    cluster = LiveCluster(None, None, groups=[RolloutGroup("tp1", tp=1, count=2, max_len=4096)])
    cluster.finished.extend([(10, 100)] * 32)
    from areal_libra.planner.replan import ReplanConfig

    cfg = ControlConfig(replan_policy=ReplanConfig(every_k=4), settle_steps=4, interval_window=4, min_history=16,
                        history=64)
    return LiveControl(cfg, _Source(), cluster, events_path=tmp_path / "control_events.jsonl")


def _rec(step: int) -> dict:
    return {"step_time_s": 10.0 + step, "timeperf/train_step": 4.0, "timeperf/rollout": 1.0}


def test_pool_state_roundtrip() -> None:
    from areal_libra.elastic.state import HybridReplica, Pool, ReplicaState

    pool = Pool(1, 2, [HybridReplica("h0"), HybridReplica("h1", 2)])
    g = pool.request_join("h0")
    for st in (ReplicaState.FETCHING, ReplicaState.ZERO_SYNC, ReplicaState.ACTIVATING, ReplicaState.TRAINING):
        assert pool.advance("h0", st, g)
    pool.fail("h1", 0)
    back = Pool.from_state(json.loads(json.dumps(pool.to_state())))
    assert back.to_state() == pool.to_state()
    assert [h.rid for h in back.in_state(ReplicaState.TRAINING)] == ["h0"] and back.counters.joins == 1
    assert not back.hybrid["h1"].alive and back.counters.failures == 1
    import pytest

    with pytest.raises(ValueError, match="bad pool state"):
        Pool.from_state({**pool.to_state(), "hybrid": [{"rid": "h0", "state": "flying"}]})


def test_snapshot_of_the_checkpoint_step_is_restored(tmp_path: Path, capsys) -> None:
    from areal_libra.live.recover import ControlStateFile

    control = _control(tmp_path)
    f = ControlStateFile(tmp_path)
    for step in range(1, 10):
        control.on_step(step, _rec(step))
        f.save(step, control.cluster, control)
    ctl = control.ctl
    assert ctl is not None and ctl.replans == 0 and ctl.last_replan == -4
    saved = json.loads((tmp_path / "control_state.json").read_text())
    assert sorted(int(s) for s in saved["snapshots"]) == list(range(1, 10))

    # killed after step 9, the checkpoint holds 7 steps: the controller resumes from its state after step 7
    g = ControlStateFile(tmp_path)
    snap = g.load(7)
    assert snap["step"] == 7 and snap["controller"]["intervals"] == [14.0, 15.0, 16.0, 17.0]
    again = _control(tmp_path)
    again.resume = snap
    again.on_step(8, _rec(8))
    assert again.ctl is not None and list(again.ctl.intervals) == [15.0, 16.0, 17.0, 18.0]
    out = capsys.readouterr().out
    assert "step 8: resumed: controller state of step 7" in out
    events = [json.loads(x) for x in (tmp_path / "control_events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "resumed"
    g.save(8, again.cluster, again)  # the snapshots after the checkpoint are dropped, the new one kept
    assert sorted(int(s) for s in json.loads(g.path.read_text())["snapshots"]) == list(range(1, 9))


def test_resume_brings_the_saved_layout_back(tmp_path: Path) -> None:
    from areal_libra.live.recover import ControlStateFile, plan_to_state

    control = _control(tmp_path)
    for step in range(1, 4):
        control.on_step(step, _rec(step))
    control.ctl.plan = _plan(tp=2, count=1)  # as if a re-plan had moved to one TP2 server
    control.ctl.replans = 1
    ControlStateFile(tmp_path).save(3, control.cluster, control)
    again = _control(tmp_path)  # restarted servers: the launch layout, 2 x TP1
    again.resume = ControlStateFile(tmp_path).load(3)
    again.on_step(4, _rec(4))
    assert [(g.tp, g.count) for g in again.cluster.groups] == [(2, 1)] and again.cluster.reconfigs == 1
    assert again.ctl.replans == 1 and plan_to_state(again.ctl.plan) == plan_to_state(_plan(tp=2, count=1))


def test_bad_or_missing_state_is_one_line_and_a_fresh_start(tmp_path: Path, capsys) -> None:
    from areal_libra.live.recover import ControlStateFile

    f = ControlStateFile(tmp_path)
    assert f.load(5) is None
    assert capsys.readouterr().out.count("\n") == 1  # missing
    (tmp_path / "control_state.json").write_text('{"step": 5, "finished": [], "snap')
    assert f.load(5) is None
    assert capsys.readouterr().out.count("\n") == 1  # cut by a kill
    control = _control(tmp_path)
    for step in range(1, 6):
        control.on_step(step, _rec(step))
    f.save(5, control.cluster, control)
    assert f.load(2) is None  # only step 5 was saved: nothing at or before the checkpoint
    capsys.readouterr()
    snap = f.load(5)
    snap["controller"]["intervals"] = "garbage"
    again = _control(tmp_path)
    again.resume = snap
    again.on_step(6, _rec(6))  # no crash: the ordinary first plan instead
    out = capsys.readouterr().out
    assert out.count("areal_libra recover:") == 1 and "starts fresh" in out
    assert again.ctl is not None and again.ctl.replans == 0 and len(again.ctl.intervals) == 0


def test_live_pool_rejoins_hybrids_that_were_training(tmp_path: Path) -> None:
    import torch.distributed as dist

    from areal_libra.elastic.state import HybridReplica, Pool, ReplicaState
    from areal_libra.elastic_runtime.core import ElasticCore, RuntimeConfig
    from areal_libra.live.elastic_live import ElasticPoolControl, LiveElastic

    saved = Pool(1, 1, [HybridReplica("h0"), HybridReplica("h1")])
    g = saved.request_join("h1")
    for st in (ReplicaState.FETCHING, ReplicaState.ZERO_SYNC, ReplicaState.ACTIVATING, ReplicaState.TRAINING):
        saved.advance("h1", st, g)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    core = ElasticCore(store, RuntimeConfig(), 0, 1, None, str(tmp_path), dict, hybrids=[("h0", 1), ("h1", 1)])
    live = LiveElastic.__new__(LiveElastic)  # the pool side only: no worker processes in a unit test
    live.core, live.rids, live.rejoin = core, ["h0", "h1"], []
    live.pool = ElasticPoolControl(core, None)
    assert live.resume(json.loads(json.dumps(saved.to_state()))) == ["h1"]
    assert core.pool.counters.joins == 1
    live._rejoin_ready()  # the restarted worker has not registered yet: nothing asked
    assert core.pool.hybrid["h1"].state == ReplicaState.ROLLOUT and live.rejoin == ["h1"]
    core.kv.set("hb/h1/0", 1)  # its heartbeat: ready
    live._rejoin_ready()
    assert core.pool.hybrid["h1"].state == ReplicaState.REQUESTED and live.rejoin == []
    assert core.pool.hybrid["h0"].state == ReplicaState.ROLLOUT
