"""One controller, two clusters: the LibraController's decisions depend only on what the cluster reports,
so the observations recorded from a simulated run, replayed through the live adapter (LiveCluster), give
the same decisions; and the controller's gate and persistence rules hold on hand-made sequences."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import pytest

from areal_libra.control import ControlConfig, LibraController, PoolView, StepObservation
from areal_libra.elastic.policy import ElasticConfig
from areal_libra.live.live_cluster import LiveCluster
from areal_libra.planner.replan import ReplanConfig
from areal_libra.sim import libra as sim_libra
from areal_libra.sim.cluster import Simulation
from areal_libra.sim.libra import SimPlanSource
from areal_libra.sim.registry import build_system
from areal_libra.sim.report import make_env


class RecordingCluster:
    """Wraps the simulator's cluster and records what it told the controller, step by step."""

    def __init__(self, inner):
        self.inner = inner
        self.steps: list[dict] = []

    def attach(self, sim):
        self.sim = sim
        self.inner.attach(sim)

    def begin(self, obs):
        sim = self.sim
        running = [g.version for g in sim.pending if not g.ready]
        # each finished row with the version its group started at, and the oldest running group's version
        self.steps.append({"obs": obs, "finished": [(*r[:2], t.step) for r, t in zip(sim.finished,
                                                                                     sim.finished_trajs)],
                           "oldest_running": min(running) if running else sim.version + 1,
                           "pools": [], "moves": []})

    def history(self, n):
        return self.inner.history(n)

    def end_fill(self):
        return self.inner.end_fill()

    def backlog_batches(self, rec):
        return self.inner.backlog_batches(rec)

    def same_layout(self, a, b):
        return self.inner.same_layout(a, b)

    def apply_plan(self, plan, step):
        self.inner.apply_plan(plan, step)

    def pool(self):
        v = self.inner.pool()
        self.steps[-1]["pools"].append(v)
        return v

    def join(self, n, step):
        done = self.inner.join(n, step)
        self.steps[-1]["moves"].append(done)
        return done

    def release(self, n, step):
        done = self.inner.release(n, step)
        self.steps[-1]["moves"].append(done)
        return done


@dataclass
class _Traj:
    prompt_tokens: int
    final_length: int
    step: int = 0


class PoolReplay:
    """The pool's answers as the simulated pool gave them (the live pool's interface: pool_view/join/release)."""

    def __init__(self):
        self.pools: list[PoolView] = []
        self.moves: list[int] = []

    def pool_view(self):
        return self.pools.pop(0)

    def join(self, n):
        return self.moves.pop(0)

    def release(self, n):
        return self.moves.pop(0)


# Two simulated runs that between them make every kind of decision: a synthetic trace whose lengths grow (the
# per-step drift of `synth_trace --growth 4` over 60 steps) on 48 A800s re-plans at step 10, moving GPUs to
# training (and keeps the plan at others); Search-R1 on 16 releases a hybrid replica at step 2, joins it at 11
# (no release at 22: pressure protection needs a waiting trainer).
# (R2E-Gym on 16, used before issue 23's measured-use gate, now keeps its plan.)
RUNS = {"growth": ("growth", "a800x48", 20), "search_r1": ("search_r1", "a800x16", 25)}


@pytest.fixture(scope="module", params=sorted(RUNS))
def recorded(request, tmp_path_factory):
    workload, cluster, steps = RUNS[request.param]
    if workload == "growth":
        from evaluation.synth_trace import main as synth_main

        workload = str(tmp_path_factory.mktemp("growth"))
        assert synth_main(["--out", workload, "--steps", str(steps), "--seed", "0",
                           "--set", "gen_drift=0.019", "--set", "calls_drift=0.019"]) == 0
    env = make_env(workload, cluster, "qwen3-14b", 0)
    # AReaL's consumption rule: under Libra's lag bound (sim.libra.BOUND_LAG) the 20-step growth trace keeps
    # its plan at step 10 (it re-plans once over 60 steps); this test is about every decision kind's replay.
    mp = pytest.MonkeyPatch()
    request.addfinalizer(mp.undo)
    mp.setattr(sim_libra, "BOUND_LAG", False)
    # Both clusters' history is the complete cohorts (control.cohorts): the live adapter is fed each finished
    # trajectory with its start version and the oldest running version the simulation had at that step.
    spec = build_system("libra", env)
    ctl = spec.controller
    rec = RecordingCluster(ctl.cluster)
    ctl.cluster = rec
    inner_on_step = ctl.ctl.on_step

    def on_step(obs, cluster):
        rec.begin(obs)
        return inner_on_step(obs, cluster)

    ctl.ctl.on_step = on_step
    sim = Simulation(env.truth, env.workload, env.n_gpus, spec.layout, spec.run, spec.router_factory(spec.layout),
                     ctl, seed=env.seed)
    # unbounded, so every row can be replayed with its version (the simulator keeps the last 4000)
    sim.finished, sim.finished_trajs = deque(sim.finished), deque(sim.finished_trajs)
    ctl.attach(sim)
    sim.run(steps)
    return env, ctl, rec


def test_sim_runs_exercise_every_decision(recorded):
    _, ctl, _ = recorded
    kinds = {e.kind for e in ctl.ctl.events}
    assert kinds & {"replan", "release"}, kinds  # growth: replan (+ kept); search_r1: release, join (+ kept)


def test_live_adapter_makes_the_same_decisions(recorded):
    env, sim_ctl, rec = recorded
    first_plan = SimPlanSource(env, False).solve(
        [(t.prompt_tokens, t.final_length) for t in env.workload.profile(env.profile_groups)])
    pool = PoolReplay()
    live = LiveCluster(None, pool, history_len=sim_ctl.ctl.cfg.history, max_tokens=env.workload.cfg.max_len)
    ctl = LibraController(sim_ctl.ctl.cfg, SimPlanSource(env, False), first_plan)
    fed = 0
    for s in rec.steps:
        for p, f, v in s["finished"][fed:]:
            live.on_trajectory(_Traj(p, f, v))
        fed = len(s["finished"])
        live.running_fn = lambda o=s["oldest_running"]: o
        pool.pools, pool.moves = list(s["pools"]), list(s["moves"])
        ctl.on_step(s["obs"], live)
    assert [(e.step, e.kind, e.detail) for e in ctl.events] == [(e.step, e.kind, e.detail)
                                                                 for e in sim_ctl.ctl.events]
    assert ctl.events and live.reconfigs == sum(e.kind == "replan" for e in ctl.events)


class _Plan:
    """A plan as the controller sees it: a predicted step time and its allocation strings."""

    def __init__(self, makespan_s: float, name: str):
        self.makespan_s, self.name = makespan_s, name
        self.rollout_gpus, self.train_gpus = 4, 4

    def rollout_alloc(self):
        return self.name

    def train_alloc(self):
        return "fsdp:d4"


class _Planner:
    def __init__(self, new: _Plan, cur_price: float):
        self.new, self.cur_price = new, cur_price

    def solve(self, history):
        return self.new

    def price(self, plan, history):
        return self.cur_price


class _Cluster:
    def __init__(self, training=0, idle=1):
        self.applied, self.moves = [], []
        self.view = PoolView(training=training, idle=idle, train_replicas=2, rollout_gpus=8, unit_gpus=1)

    def history(self, n):
        return [(10, 100)] * 32

    def same_layout(self, a, b):
        return a.name == b.name

    def apply_plan(self, plan, step):
        self.applied.append((step, plan.name))

    def pool(self):
        return self.view

    def join(self, n, step):
        self.moves.append(("join", step))
        return n

    def release(self, n, step):
        self.moves.append(("release", step))
        return n


def _obs(step, interval=10.0, train=5.0, roll=5.0, active=0.0):
    return StepObservation(step, interval, train, roll, 0.0, active)


def test_gate_applies_only_when_gain_beats_cost():
    cfg = ControlConfig(replan_policy=ReplanConfig(every_k=10, reconfig_cost_s=3.0))
    # Measured 10 s; current plan priced 5 s, new 4 s -> scaled 8 s: gain 2 s < cost 3 s: kept.
    ctl = LibraController(cfg, _Planner(_Plan(4.0, "new"), 5.0), _Plan(5.0, "cur"))
    cl = _Cluster()
    for s in range(1, 11):
        ctl.on_step(_obs(s), cl)
    assert [e.kind for e in ctl.events] == ["kept"] and not cl.applied
    # New plan priced 3 s -> scaled 6 s: gain 4 s > 3 s and 40% > 5%: applied at the periodic step.
    ctl = LibraController(cfg, _Planner(_Plan(3.0, "new"), 5.0), _Plan(5.0, "cur"))
    cl = _Cluster()
    for s in range(1, 11):
        ctl.on_step(_obs(s), cl)
    assert cl.applied == [(10, "new")] and ctl.replans == 1 and ctl.metrics()["plan/replans"] == 1.0


@pytest.mark.parametrize("last_step, applied", [(None, [(10, "new")]), (11, [(10, "new")]), (10, [])])
def test_uncalibrated_gate_credits_no_gain_beyond_the_runs_last_step(last_step, applied):
    # The applied move of the test above, decided at step 10: nothing to credit when 10 is the run's last step.
    cfg = ControlConfig(replan_policy=ReplanConfig(every_k=10, reconfig_cost_s=3.0), last_step=last_step)
    ctl = LibraController(cfg, _Planner(_Plan(3.0, "new"), 5.0), _Plan(5.0, "cur"))
    cl = _Cluster()
    for s in range(1, 11):
        ctl.on_step(_obs(s), cl)
    assert cl.applied == applied
    if not applied:
        assert ctl.events[-1].kind == "kept" and "gain x 0 steps" in ctl.events[-1].detail


def test_elastic_acts_only_on_a_persistent_verdict():
    cfg = ControlConfig(replan=False, elastic_persist=3, elastic_policy=ElasticConfig(cooldown_steps=0),
                        elastic_project=False, staleness=1)  # decisions from step 2 (the fill: eta + 1)
    ctl = LibraController(cfg, _Planner(_Plan(1.0, "x"), 1.0), _Plan(1.0, "x"))
    cl = _Cluster(training=0, idle=1)
    # T_train/T_rollout = 2 (join) twice, then rollout-bound (means over the window): no persistent verdict.
    for s, roll in ((2, 5.0), (3, 5.0), (4, 50.0)):
        ctl.on_step(_obs(s, train=10.0, roll=roll), cl)
    assert cl.moves == []
    ctl = LibraController(cfg, _Planner(_Plan(1.0, "x"), 1.0), _Plan(1.0, "x"))
    for s in (2, 3, 4):
        ctl.on_step(_obs(s, train=10.0), cl)
    assert cl.moves == [("join", 4)]
    # Rollout pressure above the protect threshold while the trainer waits releases at once, without
    # persistence; a full pool the trainer does not wait for is rollout running ahead, not released.
    cl = _Cluster(training=1, idle=0)
    ctl.on_step(_obs(5, active=0.95), cl)
    assert cl.moves == []
    ctl.on_step(_obs(6, roll=8.0, active=0.95), cl)
    assert cl.moves == [("release", 6)]


class _ScriptCluster(_Cluster):
    """A pool whose joins and releases take effect at once (one hybrid)."""

    def join(self, n, step):
        self.view = PoolView(training=1, idle=0, train_replicas=3, rollout_gpus=7, unit_gpus=1)
        return super().join(n, step)

    def release(self, n, step):
        self.view = PoolView(training=0, idle=1, train_replicas=2, rollout_gpus=8, unit_gpus=1)
        return super().release(n, step)


def test_no_decision_in_the_pipelines_fill():
    """The first eta + 1 steps are the asynchronous pipeline's fill: a full pool while the trainer waits there
    releases nothing (it did at step 2 on every 128 x 16 run, each move predicted 0.31-1.97x of the next 5
    steps); from step eta + 1 the same observation releases at once."""
    assert ControlConfig().warmup == 5 and ControlConfig(staleness=8).warmup == 9
    assert ControlConfig(staleness=8, warmup_steps=2).warmup == 2
    with pytest.raises(ValueError, match="staleness"):
        ControlConfig(staleness=-1)
    cfg = ControlConfig(replan=False, staleness=4)
    ctl = LibraController(cfg, _Planner(_Plan(1.0, "x"), 1.0), _Plan(1.0, "x"))
    cl = _Cluster(training=1, idle=0)
    for s in range(1, 5):
        ctl.on_step(_obs(s, roll=8.0, active=0.95), cl)
    assert cl.moves == [] and ctl.events == []
    ctl.on_step(_obs(5, roll=8.0, active=0.95), cl)
    assert cl.moves == [("release", 5)]


def test_scheduled_policy_is_one_more_policy_behind_the_same_interface():
    """The join_at_step/release_after script goes through the controller like the measured policy: join at
    step 5 (no persistence wait), release 3 steps after training started, never join again; rollout pressure
    still protects."""
    from areal_libra.elastic.policy import ScheduledPolicy

    cfg = ControlConfig(replan=False, elastic_persist=6, warmup_steps=2)
    ctl = LibraController(cfg, _Planner(_Plan(1.0, "x"), 1.0), _Plan(1.0, "x"), ScheduledPolicy(5, 3))
    cl = _ScriptCluster(training=0, idle=1)
    for s in range(2, 16):
        ctl.on_step(_obs(s, train=10.0), cl)  # T_train/T_rollout 2: the measured policy would join at once
    assert cl.moves == [("join", 5), ("release", 9)]
    ctl = LibraController(cfg, _Planner(_Plan(1.0, "x"), 1.0), _Plan(1.0, "x"), ScheduledPolicy(2))
    cl = _ScriptCluster(training=0, idle=1)
    ctl.on_step(_obs(2), cl)
    ctl.on_step(_obs(3, active=0.95), cl)
    assert cl.moves == [("join", 2), ("release", 3)]
    with pytest.raises(ValueError):
        ScheduledPolicy(2, 0)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="interval_window"):
        ControlConfig(interval_window=0)
    with pytest.raises(ValueError, match="every_k"):
        ControlConfig(replan_policy=ReplanConfig(every_k=0))
    with pytest.raises(ValueError, match="elastic_persist"):
        ControlConfig(elastic_persist=0)


class _LenientReplay(PoolReplay):
    """The recorded pool answers while they last, then the last view; a move does what was asked."""

    last = None

    def pool_view(self):
        if self.pools:
            self.last = self.pools.pop(0)
        return self.last

    def join(self, n):
        return self.moves.pop(0) if self.moves else n

    def release(self, n):
        return self.moves.pop(0) if self.moves else n


def _replay(ctl, live, pool, steps, fed):
    for s in steps:
        for p, f, v in s["finished"][fed:]:
            live.on_trajectory(_Traj(p, f, v))
        fed = len(s["finished"])
        live.running_fn = lambda o=s["oldest_running"]: o
        pool.pools, pool.moves = list(s["pools"]), list(s["moves"])
        ctl.on_step(s["obs"], live)
    return fed


@pytest.mark.parametrize("k", [6, 13])
def test_restored_controller_makes_the_same_decisions(recorded, tmp_path, k):
    """Stop after step k (state saved to control_state.json as the live run does), restore into a new
    controller and cluster, continue: the decisions are those of the run that never stopped; a controller
    that re-starts fresh from the same plan and history (when it had acted before k) ends elsewhere."""
    from types import SimpleNamespace

    from areal_libra.live.recover import ControlStateFile, plan_from_state, restore_control_state

    env, sim_ctl, rec = recorded
    cfg = sim_ctl.ctl.cfg
    first_plan = SimPlanSource(env, False).solve(
        [(t.prompt_tokens, t.final_length) for t in env.workload.profile(env.profile_groups)])

    def decisions(c):
        return [(e.step, e.kind, e.detail) for e in c.events]

    pool = PoolReplay()
    live = LiveCluster(None, pool, history_len=cfg.history, max_tokens=env.workload.cfg.max_len)
    whole = LibraController(cfg, SimPlanSource(env, False), first_plan)
    _replay(whole, live, pool, rec.steps, 0)

    pool = PoolReplay()
    live = LiveCluster(None, pool, history_len=cfg.history, max_tokens=env.workload.cfg.max_len)
    first = LibraController(cfg, SimPlanSource(env, False), first_plan)
    fed = _replay(first, live, pool, rec.steps[:k], 0)
    ControlStateFile(tmp_path).save(rec.steps[k - 1]["obs"].step, live, SimpleNamespace(ctl=first))

    live2 = LiveCluster(None, pool, history_len=cfg.history, max_tokens=env.workload.cfg.max_len)
    restore_control_state(tmp_path, live2)
    snap = ControlStateFile(tmp_path).load(rec.steps[k - 1]["obs"].step)
    from areal_libra.control.controller import ControlEvent

    resumed = LibraController.from_state(cfg, SimPlanSource(env, False), plan_from_state(snap["plan"]),
                                         snap["controller"], [ControlEvent(*e) for e in snap["events"]])
    assert resumed.to_state() == first.to_state() and resumed.replans == first.replans
    _replay(resumed, live2, pool, rec.steps[k:], fed)
    assert decisions(resumed) == decisions(whole) and whole.events
    assert resumed.replans == whole.replans and resumed.last_replan == whole.last_replan

    fresh = LibraController(cfg, SimPlanSource(env, False), plan_from_state(snap["plan"]))
    pool = _LenientReplay()  # the fresh controller's moves differ from the recorded ones
    live3 = LiveCluster(None, pool, history_len=cfg.history, max_tokens=env.workload.cfg.max_len)
    restore_control_state(tmp_path, live3)
    _replay(fresh, live3, pool, rec.steps[k:], fed)
    if first.replans or first.last_change is not None:  # it had acted before k: a fresh start forgets it
        assert fresh.to_state() != whole.to_state()


def test_controller_state_rejects_malformed_input():
    cfg = ControlConfig(elastic_persist=3)
    ctl = LibraController(cfg, _Planner(_Plan(1.0, "x"), 1.0), _Plan(1.0, "x"))
    for s in range(1, 6):
        ctl.on_step(_obs(s, train=10.0), _Cluster())
    state = ctl.to_state()
    import json

    back = LibraController.from_state(cfg, ctl.planner, ctl.plan, json.loads(json.dumps(state)))
    assert back.to_state() == state and back.last_change == ctl.last_change
    for bad in ({}, {**state, "verdicts": 3}, {**state, "last_replan": "x"}):
        with pytest.raises(ValueError, match="bad controller state"):
            LibraController.from_state(cfg, ctl.planner, ctl.plan, bad)
