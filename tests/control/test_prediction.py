"""How well the controller predicts (control/prediction.py, issue 23): the Spearman of the calibrated Cost
Evaluator's ranking of layouts it did not choose, an elastic move's predicted step, and the per-decision
prediction report."""

import random
from dataclasses import replace

import pytest

from areal_libra.control import ControlConfig, LibraController, PoolView, StepObservation
from areal_libra.control.calibration import Factors
from areal_libra.control.prediction import (
    RankingProbe,
    layout_plan,
    prediction_summary,
    projected_step_s,
    ranks,
    spearman,
)
from areal_libra.cost.training import TrainParallel
from areal_libra.planner import PlannerConfig, solve
from areal_libra.planner.evaluate import price
from areal_libra.planner.replan import ReplanConfig
from tests.control._fakes import NoElasticPool


def test_ranks_average_ties():
    assert ranks([3.0, 1.0, 2.0, 2.0]) == [4.0, 1.0, 2.5, 2.5]


def test_spearman_monotone_reversed_and_ties():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 400]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # x ranks (1, 2.5, 2.5, 4), y ranks (1, 3, 2, 4): Pearson of the ranks = 4.5 / sqrt(4.5 * 5)
    assert spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(4.5 / (4.5 * 5) ** 0.5)
    assert spearman([1, 1, 1], [1, 2, 3]) is None  # one side constant: not defined
    assert spearman([1], [2]) is None
    with pytest.raises(ValueError):
        spearman([1, 2], [1, 2, 3])


def _history(seed=0, n=400):
    rng = random.Random(seed)
    return [(p, p + rng.randint(500, 6000)) for p in (rng.randint(200, 1500) for _ in range(n))]


class _Evaluator:
    """The real Cost Evaluator on a preset cluster (what SimPlanSource / the live plan source call)."""

    cfg = PlannerConfig(global_batch=256, mode="async", staleness=4)

    def price_terms(self, plan, history):
        p = price(plan, "a800x48", "qwen3-14b", history, self.cfg)
        return p.t_train_s, p.t_rollout_s, 0.0


def _candidates():
    plans, names = [], []
    for roll in (8, 16, 24, 32, 40):
        train = 48 - roll
        plans.append(layout_plan(roll, 4, TrainParallel(2, 1, train // 2), 16384))
        names.append(f"{roll}xTP4")
    return plans, names


def test_layout_plan_is_priced_like_a_solved_plan():
    h = _history()
    cfg = _Evaluator.cfg
    solved = solve("a800x48", "qwen3-14b", h, PlannerConfig(global_batch=256, mode="async", staleness=4,
                                                             allowed_tp=(4,), fill_tp=()))
    as_layout = layout_plan(solved.rollout_gpus, 4, solved.train, 16384)
    p = price(as_layout, "a800x48", "qwen3-14b", h, cfg)
    assert p.t_train_s == pytest.approx(solved.t_train_s, rel=0.02)
    assert p.t_rollout_s > 0
    with pytest.raises(ValueError):
        layout_plan(10, 4, TrainParallel(2, 1, 19), 16384)


def test_probe_ranks_by_the_calibrated_evaluator():
    h = _history()
    plans, names = _candidates()
    ev = _Evaluator()
    base = [1.0 / t for t in RankingProbe(plans, [0.0] * 5).predicted_step_s(ev, h, Factors())]
    # Measured throughput that follows the uncalibrated evaluator: a perfect ranking at factors 1.0 ...
    probe = RankingProbe(plans, base, from_step=5, labels=names)
    assert probe.observe(4, ev, h, Factors()) is None  # before from_step: nothing priced
    assert probe.observe(5, ev, h, Factors()) == pytest.approx(1.0)
    assert probe.record["last_predicted_best"] == probe.record["measured_best"]
    # ... and a worse one once a 4x training factor is in force: the factors are the ones priced with.
    rho = probe.observe(6, ev, h, Factors(train=4.0))
    assert rho is not None and rho < 0.9
    assert probe.record["steps"] == [5, 6] and probe.record["min"] == pytest.approx(rho, abs=1e-4)
    assert probe.record["spearman_uncalibrated"] == [pytest.approx(1.0), pytest.approx(1.0)]
    # Measured throughput in the opposite order: -1.
    rev = RankingProbe(plans, [-x for x in base])
    assert rev.observe(5, ev, h, Factors()) == pytest.approx(-1.0)


class _LoopEvaluator(_Evaluator):
    """The real Cost Evaluator, pricing another loop's config fields when the probe passes them."""

    def __init__(self):
        self.calls = []

    def price_terms(self, plan, history, **loop):
        self.calls.append(loop)
        p = price(plan, "a800x48", "qwen3-14b", history, replace(self.cfg, global_batch=2048, **loop))
        return p.t_train_s, p.t_rollout_s, 0.0


def test_probe_prices_its_candidates_under_their_own_loop():
    # Long multi-turn contexts: under AReaL's loop (no working-set admission) the small rollout pools evict.
    rng = random.Random(1)
    h = [(p, p + rng.randint(2000, 20000)) for p in (rng.randint(1000, 4000) for _ in range(1000))]
    plans, names = [], []
    for roll in (8, 16, 24, 32, 40):
        plans.append(layout_plan(roll, 2, TrainParallel(2, 1, (48 - roll) // 2), 40960))
        names.append(f"{roll}xTP2")
    areal = {"admission": "unbounded", "tool_returns": 6.0}
    ev = _LoopEvaluator()
    own = RankingProbe(plans, [0.0] * 5).predicted_step_s(ev, h, Factors())
    assert ev.calls == [{}] * 5  # no loop given: the evaluator's own
    other = RankingProbe(plans, [0.0] * 5, loop=areal)
    theirs = other.predicted_step_s(ev, h, Factors())
    assert ev.calls[5:] == [areal] * 5
    assert all(b >= a for a, b in zip(own, theirs)) and theirs[0] > own[0]
    # Ranked against throughput measured under AReaL's loop (here: the evaluator's own figures for it), the
    # probe that prices that loop ranks perfectly and records the loop; one pricing Libra's does not.
    measured = [1.0 / t for t in theirs]
    probe = RankingProbe(plans, measured, from_step=0, labels=names, loop=areal)
    assert probe.observe(0, ev, h, Factors()) == pytest.approx(1.0) and probe.record["loop"] == areal
    assert RankingProbe(plans, measured, from_step=0, labels=names).observe(0, ev, h, Factors()) < 1.0


class _Cluster(NoElasticPool):
    def __init__(self, hist):
        self.hist = hist

    def history(self, n):
        return self.hist[-n:]

    def same_layout(self, a, b):
        return a is b

    def apply_plan(self, plan, step):
        raise AssertionError("no re-plan expected")


class _Source(_Evaluator):
    def solve(self, history):
        raise AssertionError("no solve expected")

    def price(self, plan, history):
        return max(self.price_terms(plan, history)[:2])

    def solve_calibrated(self, history, factors):
        raise AssertionError("no solve expected")


def test_controller_probes_every_step_from_step_5_with_its_history():
    h = _history()
    plans, names = _candidates()
    base = [1.0 / t for t in RankingProbe(plans, [0.0] * 5).predicted_step_s(_Evaluator(), h, Factors())]
    ctl = LibraController(ControlConfig(replan=False, replan_policy=ReplanConfig(every_k=100)), _Source(), plans[1])
    probe = ctl.rankings["ranking"] = RankingProbe(plans, base, from_step=5, labels=names)
    # A second probe (other measurements of the same layouts, here ranked the other way round) is priced beside
    # it from its own step.
    other = ctl.rankings["ranking_own_loop"] = RankingProbe(plans, [1.0 / b for b in base], from_step=7,
                                                          labels=names)
    cl = _Cluster(h)
    for s in range(0, 9):
        ctl.on_step(StepObservation(s, 20.0, 10.0, 10.0, tokens=1000.0), cl)
    assert probe.record["steps"] == [5, 6, 7, 8] and other.record["steps"] == [7, 8]
    assert other.record["spearman"][-1] == pytest.approx(-probe.record["spearman"][-1], abs=1e-4)
    # The controller calibrated on the steps (a measured 10 s training against the model's): the probe priced
    # with the factors in force, which rank the candidates otherwise than the uncalibrated evaluator.
    f = ctl.factors
    assert f.train != pytest.approx(1.0)
    pred = probe.predicted_step_s(_Evaluator(), h, f)
    assert probe.record["spearman"][-1] == pytest.approx(spearman([1.0 / t for t in pred], base), abs=1e-4)
    assert probe.record["spearman"][-1] < 1.0


def test_projected_step_of_an_elastic_move():
    # 3 replicas train in 90 s, 24 rollout GPUs need 30 s, 2 s neither side explains: one 4-GPU replica joins.
    assert projected_step_s(90.0, 30.0, 92.0, 3, 24, 4, 1) == pytest.approx(90.0 * 3 / 4 + 2.0)
    # A release: rollout gains 4 GPUs, training loses a replica; rollout no longer binds.
    assert projected_step_s(30.0, 60.0, 62.0, 4, 20, 4, -1) == pytest.approx(max(40.0, 60.0 * 20 / 24) + 2.0)
    assert projected_step_s(90.0, 30.0, 92.0, 1, 24, 4, -1) is None  # would empty training


def test_prediction_summary_flags_moves_outside_the_band():
    preds = [{"step": 10, "kind": "kept", "predicted_s": 130.0, "measured_s": 100.0, "ratio": 1.3},
             {"step": 20, "kind": "replan", "predicted_s": 110.0, "measured_s": 100.0, "ratio": 1.1},
             {"step": 25, "kind": "join", "predicted_s": 80.0, "measured_s": 100.0, "ratio": 0.8}]
    s = prediction_summary(preds)
    assert s["n"] == 3 and s["n_moves"] == 2
    assert not s["moves_within"] and not s["all_within"] and s["outside"] == [10, 25]
    s = prediction_summary(preds[1:2])
    assert s["moves_within"] and s["all_within"] and s["outside"] == []
    assert s["decisions"] == [{"step": 20, "kind": "replan", "predicted_s": 110.0, "measured_next_s": 100.0,
                               "ratio": 1.1}]


class _PoolCluster(_Cluster):
    """One idle 4-GPU hybrid replica beside 3 training replicas and 24 rollout GPUs; join moves it."""

    def __init__(self, hist):
        super().__init__(hist)
        self.training = 0

    def pool(self):
        return PoolView(training=self.training, idle=1 - self.training, train_replicas=3 + self.training,
                        rollout_gpus=24 - 4 * self.training, unit_gpus=4)

    def join(self, n, step):
        self.training = 1
        return 1


def test_elastic_move_is_predicted_on_the_window_it_was_decided_on():
    from areal_libra.elastic.policy import ScheduledPolicy

    ctl = LibraController(ControlConfig(replan=False, calibrate=False), _Source(), None,
                          elastic_policy=ScheduledPolicy(join_at_step=9))
    cl = _PoolCluster(_history())
    # Three slow warm-up steps (500 s), then steps of 90 s training, 30 s rollout, 92 s intervals; the join at
    # step 9 is predicted from the last 4 steps alone: 90 x 3/4 + 2 s, then scored on the next 5 steps.
    for s in range(0, 3):
        ctl.on_step(StepObservation(s, 500.0, 90.0, 30.0), cl)
    for s in range(3, 15):
        ctl.on_step(StepObservation(s, 92.0 if s <= 9 else 69.5, 90.0, 30.0), cl)
    (p,) = [p for p in ctl.predictions if p["kind"] == "join"]
    assert p["step"] == 9
    assert p["predicted_s"] == pytest.approx(90.0 * 3 / 4 + 2.0)
    assert p["ratio"] == pytest.approx((90.0 * 3 / 4 + 2.0) / 69.5)
