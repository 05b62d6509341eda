"""Online per-term calibration (control/calibration.py), the factors in solve and price, and the calibrated
gate with its predictions scored against the next measured steps (issue 23 builds 3 and 5)."""

import random

import pytest

from areal_libra.control import ControlConfig, LibraController, PoolView, StepObservation
from areal_libra.control.calibration import Factors, StepCalibration
from areal_libra.planner import PlannerConfig, solve
from areal_libra.planner.evaluate import price
from areal_libra.planner.replan import ReplanConfig
from tests.control._fakes import NoElasticPool


def test_train_factor_is_the_median_of_measured_over_modelled():
    cal = StepCalibration(window=10, settle=2)
    for i in range(12):
        noisy = 20.0 if i == 7 else 2.0  # one slow step does not move a median
        cal.observe(interval_s=40.0 * noisy / 2, train_s=10.0 * noisy, wait_s=0.0, t_train_model=5.0,
                    t_roll_model=10.0)
    assert cal.factors.train == pytest.approx(4.0)


def test_rollout_factor_rises_on_waited_steps_and_only_falls_to_bounds():
    cal = StepCalibration(window=10, settle=0)
    for _ in range(6):  # the trainer waited 20 s each step: rollout took train + wait = 30 s vs 10 s modelled
        cal.observe(interval_s=32.0, train_s=10.0, wait_s=20.0, t_train_model=10.0, t_roll_model=10.0)
    assert cal.factors.rollout == pytest.approx(3.0)
    assert cal.factors.fixed_s == pytest.approx(2.0)
    cal.layout_changed()
    for _ in range(6):  # rollout keeps up: T_rollout <= 12 s, an upper bound of 1.2 on the factor
        cal.observe(interval_s=14.0, train_s=12.0, wait_s=0.0, t_train_model=10.0, t_roll_model=10.0)
    assert cal.factors.rollout == pytest.approx(1.2)
    for _ in range(6):  # a looser bound (rollout kept up with a slower trainer) never raises it
        cal.observe(interval_s=32.0, train_s=30.0, wait_s=0.0, t_train_model=10.0, t_roll_model=10.0)
    assert cal.factors.rollout == pytest.approx(1.2)


def test_waited_steps_count_against_the_same_window_as_the_others():
    # Rare waits (one step in five, the trainer waiting for a straggler) must not outlive the window: after 30
    # steps the last 10 hold two waits, below the third that fits the factor on them, so only the bounds act.
    cal = StepCalibration(window=10, settle=0)
    for i in range(30):
        wait = 20.0 if i % 5 == 4 else 0.0
        cal.observe(interval_s=12.0 + wait, train_s=10.0, wait_s=wait, t_train_model=10.0, t_roll_model=10.0)
    assert len(cal.roll_bound) == 2 and len(cal.roll_upper) == 8
    assert cal.factors.rollout == pytest.approx(1.0)  # never raised to the waits' 3.0
    # Waits on half the steps are rollout falling behind: the factor is theirs.
    for i in range(10):
        wait = 20.0 if i % 2 else 0.0
        cal.observe(interval_s=12.0 + wait, train_s=10.0, wait_s=wait, t_train_model=10.0, t_roll_model=10.0)
    assert cal.factors.rollout == pytest.approx(3.0)


def test_calibration_state_round_trips_and_reads_the_older_format():
    cal = StepCalibration(window=10, settle=0)
    for i in range(7):
        cal.observe(interval_s=32.0, train_s=10.0, wait_s=20.0 if i % 2 else 0.0, t_train_model=10.0,
                    t_roll_model=10.0)
    again = StepCalibration(window=10, settle=0)
    again.load_state(cal.to_state())
    assert list(again.roll) == list(cal.roll) and again.factors == cal.factors
    old = {k: v for k, v in cal.to_state().items() if k != "roll"}
    old.update(roll_bound=[3.0, 3.0], roll_upper=[1.0])
    again.load_state(old)
    assert again.roll_bound == [3.0, 3.0] and again.roll_upper == [1.0]


def test_history_covers_the_batches_in_flight():
    cfg = ControlConfig(staleness=4)
    assert cfg.covering(2048).history == 5 * 2048  # 128 x 16: five batches, not one cohort
    assert cfg.covering(128).history == cfg.history  # never fewer rows than configured


def _history(seed=0, n=400):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = rng.randint(200, 1500)
        out.append((p, p + rng.randint(500, 6000)))
    return out


def test_measurement_changes_which_plan_wins():
    """A training term measured 3x slower than modelled moves GPUs to training; solve and price agree."""
    h = _history()
    base = PlannerConfig(global_batch=256, mode="async", staleness=4)
    p1 = solve("a800x48", "qwen3-14b", h, base)
    slow = PlannerConfig(global_batch=256, mode="async", staleness=4, train_factor=3.0)
    p3 = solve("a800x48", "qwen3-14b", h, slow)
    assert p3.train_gpus > p1.train_gpus
    # price() of a plan applies the same factors the solve used
    pr = price(p3, "a800x48", "qwen3-14b", h, slow)
    assert pr.t_train_s == pytest.approx(p3.t_train_s, rel=0.02)
    assert price(p1, "a800x48", "qwen3-14b", h, slow).t_train_s == pytest.approx(
        3.0 * price(p1, "a800x48", "qwen3-14b", h, base).t_train_s)


class _Plan:
    def __init__(self, name, t_train, t_roll):
        self.name, self.t_train, self.t_roll = name, t_train, t_roll
        self.makespan_s = max(t_train, t_roll)
        self.rollout_gpus = self.train_gpus = 4

    def rollout_alloc(self):
        return self.name

    def train_alloc(self):
        return "megatron:d4"


def _split(plan, rollout_gpus, train_gpus):
    plan.rollout_gpus, plan.train_gpus = rollout_gpus, train_gpus
    return plan


class _CalPlanner:
    """The new plan is the one that is best once the factors are applied."""

    def __init__(self, plans):
        self.plans, self.solved_with = plans, []

    def solve(self, history):
        return self.plans[0]

    def price(self, plan, history):
        return plan.makespan_s

    def solve_calibrated(self, history, factors):
        self.solved_with.append(factors)
        return min(self.plans, key=lambda p: factors.step_s(p.t_train, p.t_roll))

    def price_terms(self, plan, history):
        return plan.t_train, plan.t_roll, 1000.0


class _Cluster(NoElasticPool):
    def __init__(self):
        self.applied = []

    def history(self, n):
        return [(10, 100)] * 64

    def same_layout(self, a, b):
        return a.name == b.name

    def apply_plan(self, plan, step):
        self.applied.append((step, plan.name))

    def reconfig_cost_s(self, a, b):
        return 30.0


def test_calibrated_gate_moves_when_the_measured_term_is_slow_and_scores_its_prediction():
    # Model: training-heavy plan A (train 10, rollout 10) vs rollout-heavy B (train 14, rollout 5). Measured:
    # rollout is 2x the model (the trainer waits 10 s every step on A), so B wins once calibrated.
    a, b = _Plan("A", 10.0, 10.0), _split(_Plan("B", 14.0, 5.0), 5, 3)
    planner = _CalPlanner([a, b])
    cfg = ControlConfig(replan_policy=ReplanConfig(every_k=10))
    ctl = LibraController(cfg, planner, a)
    cl = _Cluster()
    for s in range(1, 11):
        ctl.on_step(StepObservation(s, 21.0, 10.0, 20.0, wait_s=10.0, tokens=1000.0), cl)
    assert ctl.factors.rollout == pytest.approx(2.0)
    assert ctl.factors.train == pytest.approx(1.0)
    assert cl.applied == [(10, "B")]
    # B's step: max(14, 2 x 5) + 1 s fixed = 15 s; then 5 steps of 15 s (the move's 30 s spread over them).
    for s in range(11, 16):
        ctl.on_step(StepObservation(s, 15.0, 14.0, 10.0, wait_s=0.0, tokens=1000.0), cl)
    (p,) = ctl.predictions
    assert p["kind"] == "replan" and p["measured_s"] == pytest.approx(15.0)
    assert p["predicted_s"] == pytest.approx(15.0 + 30.0 / 5)
    assert ctl.metrics()["plan/predicted_vs_measured_step"] == pytest.approx(21.0 / 15.0)


@pytest.mark.parametrize("last_step, applied", [(None, [(10, "B")]), (20, [(10, "B")]), (11, []), (10, [])])
def test_calibrated_gate_credits_no_gain_beyond_the_runs_last_step(last_step, applied):
    # The move of the test above gains 6 s a step against a 30 s cost: worth it over 10 steps or 9 (to step 20),
    # not over 1 step (a run ending at step 11), nor when the decision comes after the last step (nothing left).
    a, b = _Plan("A", 10.0, 10.0), _split(_Plan("B", 14.0, 5.0), 5, 3)
    cfg = ControlConfig(replan_policy=ReplanConfig(every_k=10), last_step=last_step)
    ctl = LibraController(cfg, _CalPlanner([a, b]), a)
    cl = _Cluster()
    for s in range(1, 11):
        ctl.on_step(StepObservation(s, 21.0, 10.0, 20.0, wait_s=10.0, tokens=1000.0), cl)
    assert cl.applied == applied
    if not applied:
        assert ctl.events[-1].kind == "kept" and f"gain x {max(0, last_step - 10)} steps" in ctl.events[-1].detail


def test_calibrated_gate_keeps_the_plan_when_gain_over_every_k_does_not_beat_the_cost():
    a, b = _Plan("A", 10.0, 10.0), _split(_Plan("B", 14.0, 5.0), 3, 5)
    planner = _CalPlanner([a, b])
    planner.solve_calibrated = lambda history, factors: b  # a solve that proposes B whatever the factors
    ctl = LibraController(ControlConfig(replan_policy=ReplanConfig(every_k=10)), planner, a)
    cl = _Cluster()
    for s in range(1, 11):  # rollout 1.1x the model: B's 15 s vs A's 12 s, no gain
        ctl.on_step(StepObservation(s, 12.0, 10.0, 11.0, wait_s=1.0, tokens=1000.0), cl)
    assert cl.applied == [] and ctl.events[-1].kind == "kept"


@pytest.mark.parametrize("busy, moves", [(0.95, False), (0.4, True)])
def test_calibrated_gate_never_takes_gpus_from_a_side_beyond_its_measured_use(busy, moves):
    # B wins once calibrated (as in the first test, factors aside); B takes one of rollout's 4 GPUs (4 -> 3).
    # Rollout measured busy 95% of the step on 4 GPUs needs 1.27 of 3: refused whatever the prices say; at 40%
    # (0.53 of 3, and less busy than training's 10 s of 21) the move goes ahead.
    a, b = _split(_Plan("A", 10.0, 10.0), 4, 4), _split(_Plan("B", 14.0, 5.0), 3, 5)
    ctl = LibraController(ControlConfig(replan_policy=ReplanConfig(every_k=10)), _CalPlanner([a, b]), a)
    cl = _Cluster()
    for s in range(1, 11):
        ctl.on_step(StepObservation(s, 21.0, 10.0, 20.0, wait_s=10.0, tokens=1000.0, rollout_busy=busy), cl)
    assert cl.applied == ([(10, "B")] if moves else [])
    if not moves:
        assert ctl.events[-1].kind == "kept" and "refused: rollout measured 0.95 busy on 4 GPUs" in ctl.events[-1].detail


def test_measured_use_starts_after_the_pipelines_fill():
    # The move of the test above, rollout measured busy 0.95 through the fill (steps 1-4, eta = 4) and a
    # transient (5-6), then 0.4: over the steps the calibration reads (5-10) the median is 0.4, and the move
    # goes ahead; counted from step 1 the fill's steps made it 0.95, and the move was refused.
    a, b = _split(_Plan("A", 10.0, 10.0), 4, 4), _split(_Plan("B", 14.0, 5.0), 3, 5)
    ctl = LibraController(ControlConfig(replan_policy=ReplanConfig(every_k=10), staleness=4), _CalPlanner([a, b]), a)
    cl = _Cluster()
    for s in range(1, 11):
        busy = 0.95 if s <= 6 else 0.4
        ctl.on_step(StepObservation(s, 21.0, 10.0, 20.0, wait_s=10.0, tokens=1000.0, rollout_busy=busy), cl)
    assert list(ctl.roll_use) == [0.95, 0.95, 0.4, 0.4, 0.4, 0.4]
    assert cl.applied == [(10, "B")]


def test_calibrated_gate_gives_gpus_only_to_the_side_that_measured_busier():
    # B takes a GPU from training (4 -> 3) for rollout; training measured busier than rollout: refused.
    a, b = _split(_Plan("A", 10.0, 10.0), 4, 4), _split(_Plan("B", 14.0, 5.0), 5, 3)
    ctl = LibraController(ControlConfig(replan_policy=ReplanConfig(every_k=10)), _CalPlanner([a, b]), a)
    cl = _Cluster()
    for s in range(1, 11):  # train 10 s of a 21 s step (0.48) while rollout is busy 0.3 of it
        ctl.on_step(StepObservation(s, 21.0, 10.0, 20.0, wait_s=10.0, tokens=1000.0, rollout_busy=0.3), cl)
    assert cl.applied == []
    assert "refused: rollout measured 0.30 busy, less than training 0.48" in ctl.events[-1].detail


def test_calibrated_gate_keeps_the_split_it_measured():
    # B differs from A only in its mix on the same GPUs: the calibrated factors do not price it.
    a, b = _Plan("A", 10.0, 10.0), _Plan("B", 14.0, 5.0)  # 4 + 4 GPUs both
    ctl = LibraController(ControlConfig(replan_policy=ReplanConfig(every_k=10)), _CalPlanner([a, b]), a)
    cl = _Cluster()
    for s in range(1, 11):
        ctl.on_step(StepObservation(s, 21.0, 10.0, 20.0, wait_s=10.0, tokens=1000.0), cl)
    assert cl.applied == [] and "same split" in ctl.events[-1].detail


def test_factors_step_time():
    assert Factors(2.0, 0.5, 1.0).step_s(10.0, 30.0) == pytest.approx(21.0)


class _StartingPool(_Cluster):
    """A live pool sized with the plan: its hybrids are in neither state while their workers start (steps 1-3),
    then train as the plan sized them; `moved` from step 8: one of them released (a move off the plan)."""

    def __init__(self):
        super().__init__()
        self.step = 0

    def pool(self):
        if self.step <= 3:
            return PoolView(training=0, idle=0, train_replicas=4, rollout_gpus=4, unit_gpus=1)
        if self.step >= 8:
            return PoolView(training=2, idle=1, train_replicas=6, rollout_gpus=5, unit_gpus=1)
        return PoolView(training=3, idle=0, train_replicas=7, rollout_gpus=4, unit_gpus=1)


def _calibrate_on(cl, last, train_s):
    """Plan A (the model's training 10 s) run for steps 1..last on cluster `cl`, training measured train_s(step)
    with a 5 s wait and 6 s besides; the controller and the calibration's observation count after each step."""
    a = _Plan("A", 10.0, 10.0)
    ctl = LibraController(ControlConfig(replan_policy=ReplanConfig(every_k=100)), _CalPlanner([a]), a)
    observed = {}
    for s in range(1, last + 1):
        cl.step = s
        t = train_s(s)
        ctl.on_step(StepObservation(s, t + 6.0, t, t, wait_s=5.0, tokens=1000.0), cl)
        observed[s] = ctl.calib.observed
    return ctl, observed


def test_calibration_goes_on_once_the_plans_pool_has_started():
    ctl, observed = _calibrate_on(_StartingPool(), 7, lambda s: 15.0)  # training measured 1.5x the model's 10 s
    # fitted on through the pool's start (not frozen at the first steps' empty pool: the latch is the started
    # pool's 3 training replicas)
    assert ctl._pool_training0 == 3
    assert observed[7] > observed[3]
    assert ctl.factors.train == pytest.approx(1.5, rel=0.05)


@pytest.mark.parametrize("train_s, factor", [(15.0 * 7 / 6, 1.5), (15.0, 1.5 * 6 / 7)])
def test_calibration_goes_on_across_an_elastic_move_on_the_pools_projection(train_s, factor):
    # From step 8 one hybrid replica is released (7 -> 6 training replicas, 4 -> 5 rollout GPUs). Training that
    # slows as the pool's projection says (7/6) is the same model error as before: the factor stays 1.5. Training
    # that does not slow is faster than the model on the moved pool: the factor falls to 1.5 x 6/7.
    ctl, observed = _calibrate_on(_StartingPool(), 24, lambda s: 15.0 if s < 8 else train_s)
    assert observed[24] > observed[8]  # not frozen while the pool is off the plan
    assert ctl.factors.train == pytest.approx(factor, rel=0.01)
    # the moved pool's steps are not the plan's own layout's measured steps
    assert all(len(v) <= 7 for v in ctl.measured.values())


class _MovingPool(_StartingPool):
    """The release of _StartingPool in flight over steps 8-9 (the live pool's RELEASING state: the replica is in
    neither state and the step ran on neither layout), done from step 10."""

    def pool(self):
        if 8 <= self.step <= 9:
            return PoolView(training=2, idle=0, train_replicas=6, rollout_gpus=4, unit_gpus=1, busy=True)
        return super().pool()


def test_calibration_skips_the_steps_a_move_is_in_flight():
    # once the move is done the released pool measures 17.5 s, the model's error unchanged (factor 1.5)
    ctl, observed = _calibrate_on(_MovingPool(), 12, lambda s: 15.0 if s < 8 else 17.5)
    assert observed[9] == observed[7] and observed[12] > observed[9]
    assert ctl.factors.train == pytest.approx(1.5, rel=0.01)


@pytest.mark.parametrize("backlog, predicted", [(0.0, 15.0 + 6.0), (2.5, 16.0 + 6.0), (0.5, 15.0 + 6.0)])
def test_a_moves_prediction_drains_the_rollout_backlog_the_old_layout_left(backlog, predicted):
    # The move of the test above, decided at a step whose servers still hold `backlog` batches of queued
    # requests: over the next 5 steps B's rollout (2.0 x 5 s a batch, calibrated) serves 5 batches plus the
    # backlog, so with 2.5 batches queued the steps take 10 x (1 + 2.5 / 5) + 1 s fixed = 16 s, not B's
    # steady 15 s; half a batch fits in B's slack. The gate's decision is the same either way.
    a, b = _Plan("A", 10.0, 10.0), _split(_Plan("B", 14.0, 5.0), 5, 3)
    ctl = LibraController(ControlConfig(replan_policy=ReplanConfig(every_k=10)), _CalPlanner([a, b]), a)
    cl = _Cluster()
    for s in range(1, 11):
        ctl.on_step(StepObservation(s, 21.0, 10.0, 20.0, wait_s=10.0, tokens=1000.0,
                                    backlog_batches=backlog if s == 10 else 0.0), cl)
    assert cl.applied == [(10, "B")]
    (p,) = ctl._pending
    assert p["kind"] == "replan" and p["predicted_s"] == pytest.approx(predicted)


def test_a_kept_up_steps_busy_time_bounds_the_predictions_rollout_factor_not_the_decisions():
    cal = StepCalibration(window=10, settle=0)
    for _ in range(6):  # rollout kept up; its GPUs were busy 4 s of each 14 s step: T_rollout <= 4 s vs 10 s modelled
        cal.observe(interval_s=14.0, train_s=12.0, wait_s=0.0, t_train_model=10.0, t_roll_model=10.0, busy_s=4.0)
    assert cal.factors.rollout == pytest.approx(1.0)  # the decisions' bound: train + wait (12 s), never raised
    assert cal.prediction_factors().rollout == pytest.approx(0.4)
    assert cal.prediction_factors().train == cal.factors.train
    again = StepCalibration(window=10, settle=0)
    again.load_state(cal.to_state())
    assert again.prediction_factors() == cal.prediction_factors()
    for _ in range(6):  # rollout falls behind: the waited steps fit the factor, and the prediction takes it
        cal.observe(interval_s=32.0, train_s=10.0, wait_s=20.0, t_train_model=10.0, t_roll_model=10.0, busy_s=30.0)
    assert cal.prediction_factors() == cal.factors and cal.factors.rollout == pytest.approx(3.0)


def test_a_move_from_a_kept_up_layout_predicts_rollout_at_its_busy_time_bound():
    # Training measured 2x the model on A, rollout kept up with its GPUs busy 30% of each 21 s step. The gate
    # moves a GPU to training (B: train 6 x 2, rollout 15 x 1.0 = 16 s with the 1 s fixed, against A's 21 s);
    # the move's recorded prediction prices B's rollout at the busy-time bound, 6.3 s / 10 s modelled = 0.63:
    # max(12, 0.63 x 15) + 1 = 13 s, plus the 30 s move over the 5 scored steps (the decision's 16 s + 6 before).
    a, b = _Plan("A", 10.0, 10.0), _split(_Plan("B", 6.0, 15.0), 3, 5)
    ctl = LibraController(ControlConfig(replan_policy=ReplanConfig(every_k=10)), _CalPlanner([a, b]), a)
    cl = _Cluster()
    for s in range(1, 11):
        ctl.on_step(StepObservation(s, 21.0, 20.0, 20.0, wait_s=0.0, tokens=1000.0, rollout_busy=0.3), cl)
    assert ctl.factors.rollout == pytest.approx(1.0) and ctl.factors.train == pytest.approx(2.0)
    assert cl.applied == [(10, "B")]
    (p,) = ctl._pending
    assert p["kind"] == "replan" and p["predicted_s"] == pytest.approx(13.0 + 6.0)
