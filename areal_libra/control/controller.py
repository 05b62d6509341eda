"""Libra's control loop, written once for the simulator and the live run.

Every training step the cluster reports a `StepObservation`. The controller then
1. re-plans every `replan_policy.every_k` steps (or early, on the re-plan policy's pressure/ratio triggers): the planner
   re-solves on the recent finished-trajectory history, both plans are priced on that history, scaled by
   the measured step time, and the new plan is applied only when the gain beats the reconfiguration cost
   (areal_libra.planner.replan);
2. otherwise asks the elastic policy (areal_libra.elastic.policy) whether a hybrid replica should join or
   leave training, and acts only on a verdict that persisted `elastic_persist` steps (a pressure release
   at once): one step's T_train/T_rollout moves with the buffer of finished groups, a real imbalance stays.

The cluster (sim/live) implements `Cluster`; the planner side implements `PlanSource`. The controller holds
no clock and no randomness, so the same observations give the same decisions on either cluster.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from statistics import median
from typing import Any, Protocol

from areal_libra.control.calibration import Factors, StepCalibration
from areal_libra.control.prediction import RankingProbe, projected_step_s
from areal_libra.control.profile import ProfilePass, first_plan
from areal_libra.elastic.policy import ElasticConfig, ElasticPolicy, scaled_terms
from areal_libra.planner.replan import ReplanConfig, ReplanPolicy


@dataclass(frozen=True)
class StepObservation:
    """What the cluster measured in one training step."""

    step: int
    interval_s: float  # wall time from the previous step's end to this one's
    train_s: float  # time the trainer spent training
    rollout_s: float  # time the trainer waited for / spent on rollout (T_rollout as the loop sees it)
    queue_pressure: float = 0.0  # queued / (queued + running) rollout requests
    active_pressure: float = 0.0  # fraction of rollout capacity in use
    wait_s: float = 0.0  # time the trainer sat ready waiting for rollout (0: rollout kept up)
    tokens: float = 0.0  # final-length tokens of the batch trained (0: unknown; calibration then per step)
    rollout_busy: float | None = None  # share of the rollout GPU time in the step spent serving (None: unknown)
    # rollout requests queued on the servers at the step's end, in batches' worth of requests (0: none or unknown)
    backlog_batches: float = 0.0


@dataclass(frozen=True)
class PoolView:
    """The Elastic Hybrid Pool as the policy needs it."""

    training: int  # hybrid replicas training now
    idle: int  # hybrid replicas serving rollout (joinable)
    train_replicas: int  # data-parallel replicas training now (core + hybrid)
    rollout_gpus: int
    unit_gpus: int  # accelerators of one hybrid replica
    busy: bool = False  # a join/release is still in flight


class Cluster(Protocol):
    """What the controller needs from a cluster (areal_libra.sim.libra.SimCluster, the live LiveCluster)."""

    def history(self, n: int) -> list[tuple[int, ...]]:
        """(prompt_tokens, final_length) of the last n finished trajectories."""

    def same_layout(self, a: Any, b: Any) -> bool:
        """Whether plans a and b put the same servers and trainer on this cluster."""

    def apply_plan(self, plan: Any, step: int) -> None:
        """Reconfigure to `plan` (drain, restart, resume); the elastic pool is rebuilt from it."""

    def pool(self) -> PoolView: ...

    def join(self, n: int, step: int) -> int:
        """Ask n idle hybrid replicas to join training; returns how many were asked."""

    def release(self, n: int, step: int) -> int:
        """Ask n training hybrid replicas to go back to rollout; returns how many were asked."""


class PlanSource(Protocol):
    """The Global Resource Planner bound to one cluster spec and model."""

    def solve(self, history: list[tuple[int, ...]]) -> Any:
        """A new Plan for this history; raises ValueError (PlanError) when none fits."""

    def price(self, plan: Any, history: list[tuple[int, ...]]) -> float:
        """The predicted step time of an existing plan on this history."""


class CalibratedPlanSource(PlanSource, Protocol):
    """A PlanSource that takes measured per-term factors (control.calibration): the controller then calibrates
    online and gates re-plans on the calibrated evaluator."""

    def solve_calibrated(self, history: list[tuple[int, ...]], factors: Factors) -> Any:
        """solve() with the training and rollout terms scaled by the factors."""

    def price_terms(self, plan: Any, history: list[tuple[int, ...]], **loop: Any) -> tuple[float, float, float]:
        """(T_train, T_rollout, final-length tokens of the batch priced) of `plan` on `history` by the
        uncalibrated evaluator; `loop`: planner config fields of another loop than the run's (RankingProbe.loop,
        e.g. admission="unbounded" for AReaL's)."""


@dataclass(frozen=True)
class ControlConfig:
    """The controller's settings, declared once: `libra.control` of a live run is this dataclass
    (areal_libra.config.ControlSettings adds the live planner's fields); the simulator builds it per rung
    (areal_libra.sim.libra.control_config). Whether the elastic pool is driven is not a setting here: the
    controller acts on whatever hybrid replicas the cluster's pool has (none: it never asks)."""

    replan: bool = True  # re-plan at all (off: the first plan stays)
    # The re-plan policy: period every_k, early triggers, the gain > cost gate (reconfig_cost_s, horizon_steps)
    replan_policy: ReplanConfig = field(default_factory=ReplanConfig)
    # After a re-plan, wait this many steps before the next one may be tried, so the gate's measured step time
    # is the new layout's in steady state, not the reconfiguration's disruption.
    settle_steps: int = 10
    interval_window: int = 10  # measured step intervals the gate averages (the current plan's step time)
    history: int = 2000  # finished trajectories the planner sees
    min_history: int = 16
    # The run's staleness bound eta (AReaL rollout.max_head_offpolicyness), set by the adapter from the run: the
    # asynchronous loop admits eta + 1 batches at once, so its first eta + 1 steps are the pipeline's fill.
    staleness: int = 4
    # No decision and no calibration in the first steps (None: the fill, staleness + 1): a fill step's times
    # and pressure describe the admission burst, not the layout (at 128 x 16 the elastic pool released a
    # replica at step 2 on every run, each predicted 0.31-1.97x of the next 5 steps; docs/pricing.md).
    warmup_steps: int | None = None
    elastic_persist: int = 6  # chosen on seed 1 of the simulator from {3, 6, 10}
    elastic_project: bool = True  # give the policy pool sizes for its overshoot check
    elastic_policy: ElasticConfig = field(default_factory=ElasticConfig)  # join/release thresholds, cooldown
    # Online calibration and the calibrated gate, when the plan source offers them (CalibratedPlanSource).
    calibrate: bool = True
    # The step number of the run's last observation, when known (the simulator counts steps from 0, a live run
    # from 1: each adapter sets its own); the gate credits a plan only with the steps after this one up to it.
    last_step: int | None = None
    predict_steps: int = 5  # a decision's prediction is held against the mean of this many next steps

    def covering(self, batch: int) -> ControlConfig:
        """These settings with the history covering the eta + 1 batches in flight: at least (staleness + 1) x
        `batch` trajectories, never fewer than `history`. The newest complete cohort is one draw of a batch's
        prompts: at 128 x 16 a history of 2,000 rows was one cohort, whose mean length ran 18% above the next
        five batches' (R2E-Gym seed 0, step 10: the re-plan predicted 1.30x the steps it then measured)."""
        return replace(self, history=max(self.history, (self.staleness + 1) * max(1, batch)))

    @property
    def warmup(self) -> int:
        """Steps without decisions: warmup_steps, or the pipeline's fill (staleness + 1)."""
        return self.warmup_steps if self.warmup_steps is not None else self.staleness + 1

    def __post_init__(self) -> None:
        if self.settle_steps < 0 or self.interval_window < 1 or (self.warmup_steps or 0) < 0 or self.staleness < 0:
            raise ValueError(f"settle_steps, warmup_steps and staleness must be >= 0 and interval_window >= 1, got "
                             f"{self.settle_steps}, {self.warmup_steps}, {self.staleness}, {self.interval_window}")
        if self.elastic_persist < 1:
            raise ValueError(f"elastic_persist must be >= 1, got {self.elastic_persist}")
        if self.min_history < 1 or self.history < self.min_history:
            raise ValueError(f"need 1 <= min_history ({self.min_history}) <= history ({self.history})")


@dataclass(frozen=True)
class ControlEvent:
    step: int
    kind: str  # replan | kept | replan_failed | join | release
    detail: str


def _layout_key(plan: Any) -> tuple[str, str]:
    return (plan.rollout_alloc(), plan.train_alloc())


def _mean(xs: deque[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


class LibraController:
    """Planner re-solve with the gain > cost gate, and the elastic pool with overshoot check and
    persistence filter. `on_step` is the whole loop body."""

    def __init__(self, cfg: ControlConfig, planner: PlanSource, plan: Any, elastic_policy: Any = None) -> None:
        """`elastic_policy`: what decides joins and releases, ElasticPolicy(cfg.elastic_policy) unless given (a
        scripted areal_libra.elastic.policy.ScheduledPolicy: the same interface)."""
        self.cfg = cfg
        self.planner = planner
        self.plan = plan
        self.replan_policy = ReplanPolicy(cfg.replan_policy) if cfg.replan else None
        self.elastic = elastic_policy if elastic_policy is not None else ElasticPolicy(cfg.elastic_policy)
        self.intervals: deque[float] = deque(maxlen=cfg.interval_window)
        self.t_train: deque[float] = deque(maxlen=4)
        self.t_roll: deque[float] = deque(maxlen=4)
        # Measured use of each side over the window (train time / interval, rollout busy share): a re-plan that
        # takes GPUs from a side must leave it the capacity it measurably used (_capacity_ok).
        self.train_use: deque[float] = deque(maxlen=cfg.interval_window)
        self.roll_use: deque[float] = deque(maxlen=cfg.interval_window)
        self.verdicts: deque[str] = deque(maxlen=cfg.elastic_persist)
        self.last_change: int | None = None
        self.last_elastic = ""  # the pool's last move (join | release): protection waits only after a release
        self.events: list[ControlEvent] = []
        self.replans = 0
        self.last_predicted_s = plan.makespan_s if plan is not None else 0.0
        # With calibration the first plan counts as a re-plan at step 0: the first decision waits a full settle
        # period, so its history is not only the trajectories that finish first.
        self.calib: StepCalibration | None = (
            StepCalibration(window=cfg.replan_policy.every_k)
            if cfg.calibrate and hasattr(planner, "solve_calibrated") and hasattr(planner, "price_terms") else None)
        self.last_replan = 0 if self.calib is not None else -cfg.settle_steps
        # Each decision's prediction against the mean of the next predict_steps measured intervals.
        self.predictions: list[dict[str, Any]] = []
        self._pending: list[dict[str, Any]] = []
        self.backlog_batches = 0.0  # the last step's queued rollout requests, in batches (StepObservation)
        # Candidate layouts with their measured throughput (a sweep's), priced every step from the probe's
        # from_step on by the calibrated evaluator: how well it ranks layouts it did not choose (reporting only).
        self.rankings: dict[str, RankingProbe] = {}  # by the name the run reports each under
        self._pool_training0: int | None = None  # hybrid replicas training when the plan was applied
        self.factor_record: dict[str, float] = Factors().as_dict()  # the factors in force, for reports
        # Measured step time per final-length token of each layout run so far (the steps after its settle):
        # a layout the run has measured is priced by its measurement, not the model, so the gate does not
        # move back to a layout that measured slower than the model said (no back-and-forth on model error).
        self.measured: dict[tuple[str, str], deque[float]] = {}

    @classmethod
    def from_profile(cls, cfg: ControlConfig, planner: PlanSource, profile: ProfilePass, elastic_policy: Any = None,
                     triples: bool = False, partial: bool = False) -> LibraController:
        """The controller of a run, its first plan solved on the whole profiling pass (control.profile), the one
        way the simulator and the live run start; ProfileError (a ValueError) for an incomplete pass unless
        `partial`, the planner's PlanError when nothing fits."""
        return cls(cfg, planner, first_plan(planner, profile, triples=triples, partial=partial), elastic_policy)

    # ------------------------------------------------------------------ state across a restart
    def to_state(self) -> dict[str, Any]:
        """The decision state (JSON-able) a restarted run resumes from; the plan and the events are the
        caller's to keep (the plan is the cluster's object, the events an append-only log)."""
        rp = self.replan_policy
        return {"intervals": list(self.intervals), "t_train": list(self.t_train), "t_roll": list(self.t_roll),
                "train_use": list(self.train_use), "roll_use": list(self.roll_use),
                "verdicts": list(self.verdicts), "last_change": self.last_change, "last_replan": self.last_replan,
                "replans": self.replans, "last_predicted_s": self.last_predicted_s,
                "calibration": None if self.calib is None else self.calib.to_state(),
                "measured": [[list(k), list(v)] for k, v in self.measured.items()],
                "pool_training0": self._pool_training0,
                "replan_trigger": None if rp is None else rp.last_trigger,
                "replan_reason": "" if rp is None else rp.last_reason}

    @classmethod
    def from_state(cls, cfg: ControlConfig, planner: PlanSource, plan: Any, state: dict[str, Any],
                   events: list[ControlEvent] | None = None, elastic_policy: Any = None) -> LibraController:
        """A controller that continues where the one that wrote `state` (to_state) stopped; ValueError when
        the state is malformed (the caller then starts fresh)."""
        try:
            ctl = cls(cfg, planner, plan, elastic_policy)
            ctl.intervals.extend(float(x) for x in state["intervals"])
            ctl.t_train.extend(float(x) for x in state["t_train"])
            ctl.t_roll.extend(float(x) for x in state["t_roll"])
            ctl.verdicts.extend(str(x) for x in state["verdicts"])
            # absent in a state written before the measured-use check: it refills in interval_window steps
            ctl.train_use.extend(float(x) for x in state.get("train_use", ()))
            ctl.roll_use.extend(float(x) for x in state.get("roll_use", ()))
            if ctl.calib is not None and state.get("calibration") is not None:
                ctl.calib.load_state(state["calibration"])
                ctl.factor_record.update(ctl.calib.factors.as_dict())
            for k, v in state.get("measured", ()):
                ctl.measured[(str(k[0]), str(k[1]))] = deque((float(x) for x in v),
                                                             maxlen=2 * cfg.replan_policy.every_k)
            p0 = state.get("pool_training0")
            ctl._pool_training0 = None if p0 is None else int(p0)
            lc = state["last_change"]
            ctl.last_change = None if lc is None else int(lc)
            ctl.last_replan = int(state["last_replan"])
            ctl.replans = int(state["replans"])
            ctl.last_predicted_s = float(state["last_predicted_s"])
            if ctl.replan_policy is not None:
                t = state["replan_trigger"]
                ctl.replan_policy.last_trigger = None if t is None else int(t)
                ctl.replan_policy.last_reason = str(state["replan_reason"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"bad controller state: {e!r}") from None
        ctl.events = list(events or [])
        return ctl

    # ------------------------------------------------------------------ the loop body
    def on_step(self, obs: StepObservation, cluster: Cluster) -> list[ControlEvent]:
        n0 = len(self.events)
        self.intervals.append(obs.interval_s)
        self.t_train.append(obs.train_s)
        self.t_roll.append(obs.rollout_s)
        # Measured use and calibration from the end of the pipeline's fill on: while the first eta + 1 batches
        # are produced from nothing, rollout is busy and the trainer waits whatever the split.
        filled = obs.step >= self.cfg.warmup
        if filled:
            if obs.interval_s > 0:
                self.train_use.append(min(1.0, obs.train_s / obs.interval_s))
            if obs.rollout_busy is not None:
                self.roll_use.append(obs.rollout_busy)
        self._score_predictions(obs)
        self.backlog_batches = obs.backlog_batches
        if self.calib is not None and filled:
            self._calibrate(obs, cluster)
        probes = [p for p in self.rankings.values() if obs.step >= p.from_step]
        if probes and hasattr(self.planner, "price_terms"):
            hist = cluster.history(self.cfg.history)
            if len(hist) >= self.cfg.min_history:
                for probe in probes:
                    probe.observe(obs.step, self.planner, hist, self.factors)
        # After a re-plan, wait settle_steps so the gate's measured step time is the new layout's in steady
        # state, not the reconfiguration's disruption.
        settled = obs.step >= self.cfg.warmup and obs.step - self.last_replan >= self.cfg.settle_steps
        # With calibration the periodic decision already prices the imbalance on the settled window; the ratio
        # trigger (one step's T_rollout estimate against T_train) would re-plan on a moment's backlog.
        ratio_in = (0.0, 0.0) if self.calib is not None else (_mean(self.t_roll), _mean(self.t_train))
        if self.replan_policy is not None and settled and self.replan_policy.should_replan(
                obs.step, obs.queue_pressure, obs.active_pressure, *ratio_in):
            if self._replan(obs.step, cluster):
                return self.events[n0:]
        if obs.step >= self.cfg.warmup:
            self._elastic(obs, cluster)
        return self.events[n0:]

    def _score_predictions(self, obs: StepObservation) -> None:
        for p in list(self._pending):
            if obs.step <= p["step"]:
                continue
            p["_seen"].append(obs.interval_s)
            if len(p["_seen"]) >= self.cfg.predict_steps:
                seen = p.pop("_seen")
                p["measured_s"] = sum(seen) / len(seen)
                p["ratio"] = p["predicted_s"] / max(1e-9, p["measured_s"])
                self._pending.remove(p)
                self.predictions.append(p)

    def _predict(self, step: int, kind: str, predicted_s: float) -> None:
        self._pending.append({"step": step, "kind": kind, "predicted_s": predicted_s, "_seen": []})

    def _calibrate(self, obs: StepObservation, cluster: Cluster) -> None:
        """Price the layout the step ran on the current history and fit the factors to what the step measured.
        While the elastic pool has moved replicas off the plan, the plan's terms are scaled onto the pool by the
        pool's own projection (scaled_terms), so the factors go on describing the model's error across moves:
        frozen there, the first decision after a move priced with the factors of before it (or none)."""
        assert self.calib is not None
        pool = cluster.pool()
        # Latched once the pool has its replicas placed: a live pool's hybrids start in neither state while their
        # workers come up (a few steps), then train as the plan sized them; that is the plan's pool, not a move.
        if self._pool_training0 is None and pool.training + pool.idle:
            self._pool_training0 = pool.training
        if pool.busy:  # a join or release in flight: the step ran on neither layout
            return
        moved = pool.training - self._pool_training0 if pool.training + pool.idle else 0
        hist = cluster.history(self.cfg.history)
        if len(hist) < self.cfg.min_history:
            return
        try:
            t_train, t_roll, tokens = self.planner.price_terms(self.plan, hist)  # type: ignore[attr-defined]
        except ValueError:
            return
        if moved:
            on_pool = scaled_terms(t_train, t_roll, pool.train_replicas - moved,
                                   pool.rollout_gpus + moved * pool.unit_gpus, pool.unit_gpus, moved)
            if on_pool is None:
                return
            t_train, t_roll = on_pool
        # Per token: a step's batch is a draw of the history, so its time is held against the model's time per
        # token of the history (one batch of hard issues is not a slow model).
        per = tokens / obs.tokens if obs.tokens > 0 and tokens > 0 else 1.0
        if obs.tokens > 0 and self.calib.since_change >= self.calib.settle and not moved:  # the plan's own layout
            self.measured.setdefault(_layout_key(self.plan), deque(maxlen=2 * self.cfg.replan_policy.every_k)
                                     ).append(obs.interval_s / obs.tokens)
        busy = None if obs.rollout_busy is None else obs.rollout_busy * obs.interval_s * per
        f = self.calib.observe(obs.interval_s, obs.train_s * per, obs.wait_s * per, t_train, t_roll,
                               fixed_s=obs.interval_s - obs.train_s - obs.wait_s, busy_s=busy)
        self.factor_record.update(f.as_dict())

    @property
    def factors(self) -> Factors:
        return self.calib.factors if self.calib is not None else Factors()

    def _horizon(self, step: int, steps: int | None = None) -> int:
        """Steps a plan applied now is credited with in the gate: `steps` (default: until the next periodic
        decision, every_k), at most the steps the run has left."""
        rp = self.replan_policy
        assert rp is not None
        horizon = rp.cfg.every_k if steps is None else steps
        if self.cfg.last_step is not None:
            horizon = max(0, min(horizon, self.cfg.last_step - step))
        return horizon

    def _cost(self, cluster: Cluster, new: Any) -> float:
        """What the cluster says moving to `new` costs (a training-layout change apart from a rollout-only
        one), else the policy's configured cost."""
        cost_fn = getattr(cluster, "reconfig_cost_s", None)
        rp = self.replan_policy
        assert rp is not None
        return float(cost_fn(self.plan, new)) if cost_fn is not None else rp.cfg.reconfig_cost_s

    def _replan(self, step: int, cluster: Cluster) -> bool:
        if self.calib is not None:
            return self._replan_calibrated(step, cluster)
        hist = cluster.history(self.cfg.history)
        if len(hist) < self.cfg.min_history:
            return False
        try:
            new = self.planner.solve(hist)
        except ValueError as e:  # PlanError: keep running on the current plan
            self.events.append(ControlEvent(step, "replan_failed", str(e)))
            return False
        if cluster.same_layout(self.plan, new):
            self.plan = new  # refresh the predictions; nothing to move
            return False
        # Price the current plan on the same history, then scale both predictions by measured/predicted for
        # the current plan, so the gate compares like with like and charges the cost in real seconds.
        try:
            t_cur_pred = self.planner.price(self.plan, hist)
        except ValueError:
            t_cur_pred = self.plan.makespan_s
        measured = _mean(self.intervals)
        scale = measured / max(1e-9, t_cur_pred)
        t_new = new.makespan_s * scale
        horizon = self._horizon(step, self.replan_policy.cfg.horizon_steps)  # the uncalibrated gate's own
        if not self.replan_policy.accept(measured, t_new, horizon_steps=horizon):
            self.events.append(ControlEvent(step, "kept", f"measured {measured:.1f}s; predicted {t_cur_pred:.1f}s "
                                            f"now vs {new.makespan_s:.1f}s new (gain x {horizon} steps)"))
            return False
        if not self._apply(cluster, new, step):
            return False
        self.events.append(ControlEvent(step, "replan", f"({self.replan_policy.last_reason}): {new.rollout_alloc()} "
                                        f"train {new.train_alloc()} (measured {measured:.1f}s -> predicted "
                                        f"{t_new:.1f}s)"))
        self.plan = new
        self.last_predicted_s = t_new
        self.replans += 1
        self.intervals.clear()
        self.last_change = self.last_replan = step
        self.last_elastic = ""
        return True

    def _apply(self, cluster: Cluster, new: Any, step: int) -> bool:
        """Switch the cluster to `new`; a refused or failed switch is recorded and the old layout keeps serving."""
        try:
            cluster.apply_plan(new, step)
        except (RuntimeError, ValueError) as e:  # live: FleetError
            self.events.append(ControlEvent(step, "reconfig_failed", str(e)))
            return False
        return True

    def _capacity_ok(self, new: Any) -> tuple[bool, str]:
        """A new plan may take GPUs from a side only if that side's measured use (median over the window) fits
        in what it keeps: use x GPUs now / GPUs after <= 1. The model's prices move with the history's tail
        and completion order; the measured use says which side had room, so a plan that would starve the side
        that was busy is refused whatever the prices say, and GPUs go only to the side that measured busier.
        With calibration a plan that keeps the split (another TP mix or training layout on the same GPUs) is
        refused too: the per-side factors were fitted on the layout in force and say nothing about another
        mix on the same side (the rollout factor depends on the TP mix), so its gain is the uncalibrated
        model's alone, the one that moved on noise."""
        if self.calib is not None and (new.rollout_gpus, new.train_gpus) == (self.plan.rollout_gpus,
                                                                             self.plan.train_gpus):
            return False, "same split (the calibrated factors do not price another mix on the same GPUs)"
        sides = (("rollout", self.roll_use, self.plan.rollout_gpus, new.rollout_gpus),
                 ("training", self.train_use, self.plan.train_gpus, new.train_gpus))
        for (name, use, now, after), (other, o_use, _, _) in zip(sides, sides[::-1]):
            if after < now and use:
                need = median(use) * now / max(1, after)
                if need > 1.0:
                    return False, f"{name} measured {median(use):.2f} busy on {now} GPUs, {need:.2f} on {after}"
            # GPUs go to the side that measured busier (the bottleneck), never to the one that had more room.
            if after > now and use and o_use and median(use) < median(o_use):
                return False, f"{name} measured {median(use):.2f} busy, less than {other} {median(o_use):.2f}"
        return True, ""

    def _replan_calibrated(self, step: int, cluster: Cluster) -> bool:
        """The gate on the calibrated evaluator: a new plan is solved on each half of the history and priced
        with the current plan on the other half by the same evaluator and factors (a plan fitted to a moment's
        completion-order noise is not priced on the sample it was fitted to; the better out-of-sample candidate
        is considered); the per-step gain is credited over every_k steps (at most the remaining ones) against
        the cost the cluster reports for this change, and the move must fit what each side measured
        (_capacity_ok)."""
        hist = cluster.history(self.cfg.history)
        if len(hist) < 2 * self.cfg.min_history:
            return False
        halves = (hist[0::2], hist[1::2])
        f = self.factors
        # Two-fold: a plan solved on each half, priced with the current plan on the other half; the candidate
        # with the larger out-of-sample gain (relative to the current plan on its half) is the one considered.
        # The planner's search returns different layouts for two samples of one distribution; one draw may miss
        # the better one.
        best = None
        try:
            for fit, test in (halves, halves[::-1]):
                cand = self.planner.solve_calibrated(fit, f)  # type: ignore[attr-defined]
                terms = self.planner.price_terms(self.plan, test)  # type: ignore[attr-defined]
                cur = f.step_s(*terms[:2])
                new_terms = self.planner.price_terms(cand, test)  # type: ignore[attr-defined]
                nxt = f.step_s(*new_terms[:2])
                if best is None or (not cluster.same_layout(self.plan, cand)
                                    and (cluster.same_layout(self.plan, best[0])
                                         or nxt / max(1e-9, cur) < best[3] / max(1e-9, best[2]))):
                    best = (cand, terms, cur, nxt, new_terms)
        except ValueError as e:  # PlanError: keep running on the current plan
            self.events.append(ControlEvent(step, "replan_failed", str(e)))
            return False
        assert best is not None
        new, cur_terms, t_cur, t_new, new_terms = best
        if cluster.same_layout(self.plan, new):
            self._predict(step, "same", t_cur)
            self.last_predicted_s = t_cur
            return False
        # Layouts measured on this run: their measured median step per token, at this history's batch tokens.
        seen_cur, seen_new = self.measured.get(_layout_key(self.plan)), self.measured.get(_layout_key(new))
        seen = bool(seen_cur and seen_new and len(seen_cur) >= 3 and len(seen_new) >= 3 and cur_terms[2] > 0)
        if seen:
            t_cur = median(seen_cur) * cur_terms[2]
            t_new = median(seen_new) * cur_terms[2]
        rp = self.replan_policy
        assert rp is not None
        horizon = self._horizon(step)
        cost = self._cost(cluster, new)
        gain = t_cur - t_new
        detail = (f"predicted {t_cur:.1f}s now vs {t_new:.1f}s new ({new.rollout_alloc()} train {new.train_alloc()}; "
                  f"factors train {f.train:.2f} rollout "
                  f"{f.rollout:.2f} fixed {f.fixed_s:.1f}s), gain x {horizon} steps vs cost {cost:.0f}s")
        fits, why = self._capacity_ok(new)
        if not fits:
            detail += f"; refused: {why}"
        if not fits or gain <= 0 or gain * horizon <= cost or gain / max(1e-9, t_cur) < rp.cfg.min_gain:
            self.events.append(ControlEvent(step, "kept", detail))
            self._predict(step, "kept", t_cur)
            self.last_predicted_s = t_cur
            return False
        if not self._apply(cluster, new, step):
            return False
        self.events.append(ControlEvent(step, "replan", f"({rp.last_reason}): {new.rollout_alloc()} train "
                                        f"{new.train_alloc()}; {detail}"))
        # The next steps pay the reconfiguration (its cost spread over the scored window) and drain the rollout
        # backlog the old layout left queued: over k steps the new servers serve k batches and the backlog, so
        # the steps take at least the new plan's rollout time per batch plus the backlog's share of it. The gate
        # weighs steady states: the backlog stays queued under the old layout too, so it is no cost of moving.
        # Where rollout kept up, the prediction prices it at the tighter, busy-time bound (prediction_factors).
        k = max(1, self.cfg.predict_steps)
        fp = self.calib.prediction_factors()  # type: ignore[union-attr]
        t_pred = t_new if seen else fp.step_s(*new_terms[:2])
        drained = fp.rollout * new_terms[1] * (1.0 + self.backlog_batches / k) + fp.fixed_s
        predicted = max(t_pred, drained) + cost / k
        self._predict(step, "replan", predicted)
        self.plan = new
        self.last_predicted_s = t_new
        self.replans += 1
        self.intervals.clear()
        self.calib.layout_changed()  # type: ignore[union-attr]
        self.last_change = self.last_replan = step
        self.last_elastic = ""
        self._pool_training0 = cluster.pool().training
        return True

    def _elastic(self, obs: StepObservation, cluster: Cluster) -> None:
        pool = cluster.pool()
        if pool.training + pool.idle == 0:
            return
        if pool.busy:  # one transition at a time: a join in flight has not changed the times yet
            return
        sizes = ({"train_replicas": pool.train_replicas, "rollout_gpus": pool.rollout_gpus,
                  "unit_gpus": pool.unit_gpus} if self.cfg.elastic_project else {})
        since = None if self.last_change is None else obs.step - self.last_change
        d = self.elastic.decide(_mean(self.t_train), _mean(self.t_roll), obs.active_pressure, pool.training,
                                pool.idle, since, step=obs.step, after_release=self.last_elastic == "release",
                                **sizes)
        self.verdicts.append(d.action)
        protect = d.action == "release" and obs.active_pressure >= self.elastic.cfg.protect_pressure
        persisted = not self.elastic.persist_verdicts or (
            len(self.verdicts) == self.cfg.elastic_persist and len(set(self.verdicts)) == 1)
        if d.action == "hold" or not (protect or persisted):
            return
        done = cluster.join(d.n, obs.step) if d.action == "join" else cluster.release(d.n, obs.step)
        if not done:
            return
        # The move's prediction (reporting only): the window the policy decided on (the steps since the last
        # move, at most 4) projected onto the pool after the move; the intervals over the same steps.
        recent = deque(list(self.intervals)[-len(self.t_train):] if self.t_train else [])
        pred = projected_step_s(_mean(self.t_train), _mean(self.t_roll), _mean(recent), pool.train_replicas,
                                pool.rollout_gpus, pool.unit_gpus, done if d.action == "join" else -done)
        if pred is not None:
            self._predict(obs.step, d.action, pred)
        self.last_change = obs.step
        self.last_elastic = d.action
        self.events.append(ControlEvent(obs.step, d.action, f"{done}: {d.reason}"))
        self.t_train.clear()
        self.t_roll.clear()
        self.verdicts.clear()

    def metrics(self) -> dict[str, float]:
        """plan/* keys for metrics.jsonl and W&B."""
        p = self.plan
        out = {"plan/replans": float(self.replans), "plan/rollout_gpus": float(p.rollout_gpus),
               "plan/train_gpus": float(p.train_gpus), "plan/predicted_step_s": float(self.last_predicted_s)}
        if self.predictions:
            out["plan/predicted_vs_measured_step"] = float(self.predictions[-1]["ratio"])
        if self.calib is not None:
            f = self.calib.factors
            out.update({"plan/factor_train": f.train, "plan/factor_rollout": f.rollout, "plan/fixed_s": f.fixed_s})
        return out
