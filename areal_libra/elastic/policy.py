"""Join/release policy of the Elastic Hybrid Pool: a pure function of measured times and pressure.

The live controller, the simulator and the benchmarks all call this one implementation, through the shared
LibraController (areal_libra.control), the one elastic decision loop. `ScheduledPolicy` is a fixed script
behind the same interface (`cfg`, `decide`, `persist_verdicts`), for demonstrations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

Action = Literal["join", "release", "hold"]


@dataclass(frozen=True)
class ElasticConfig:
    """Thresholds (public Libra defaults) and step limits of the hybrid-pool policy.

    join when T_train / T_rollout >= join_ratio, release when it is <= release_ratio (the gap between
    the two is the hysteresis band), and always release towards rollout when rollout pressure
    >= protect_pressure, because a starved rollout side stalls the whole asynchronous loop.
    """

    join_ratio: float = 1.15
    release_ratio: float = 0.90
    protect_pressure: float = 0.80
    max_join_per_decision: int = 1
    max_release_per_decision: int = 1
    # Decisions are suppressed for this many steps after a change, so a join is not undone before its
    # effect on the measured times shows up (4: its effect shows in the measured times by then).
    cooldown_steps: int = 4

    def __post_init__(self) -> None:
        if not (self.release_ratio > 0 and self.join_ratio > self.release_ratio):
            raise ValueError(
                f"need 0 < release_ratio < join_ratio, got release_ratio={self.release_ratio} join_ratio={self.join_ratio}"
            )
        if not 0.0 <= self.protect_pressure <= 1.0:
            raise ValueError(f"protect_pressure must be in [0, 1], got {self.protect_pressure}")
        if self.max_join_per_decision < 1 or self.max_release_per_decision < 1:
            raise ValueError("max_join_per_decision and max_release_per_decision must be >= 1")
        if self.cooldown_steps < 0:
            raise ValueError(f"cooldown_steps must be >= 0, got {self.cooldown_steps}")


@dataclass(frozen=True)
class Decision:
    action: Action
    n: int
    reason: str


class ElasticPolicy:
    """Deterministic join/release decisions; holds no state between calls."""

    # Its verdicts come from measured times that move with the buffer of finished groups: the controller acts
    # only on one that persisted ControlConfig.elastic_persist steps.
    persist_verdicts = True

    def __init__(self, cfg: ElasticConfig | None = None) -> None:
        self.cfg = cfg or ElasticConfig()

    def decide(
        self,
        t_train_s: float,
        t_rollout_s: float,
        rollout_pressure: float,
        n_active: int,
        n_idle: int,
        steps_since_change: int | None = None,
        *,
        train_replicas: int | None = None,
        rollout_gpus: int | None = None,
        unit_gpus: int | None = None,
        step: int | None = None,
        after_release: bool = False,
    ) -> Decision:
        """n_active: hybrid replicas training now; n_idle: hybrid replicas serving rollout (joinable).
        `after_release`: the last change (steps_since_change ago) was a release.
        `step` (the training step) is for scripted policies; this one does not read it.

        With `train_replicas` (data-parallel replicas training now, core + active hybrid), `rollout_gpus`
        and `unit_gpus` (GPUs of one hybrid replica) given, a move is made only if it does not overshoot:
        the ratio projected after it (training time scales with 1/replicas, rollout time with
        1/rollout GPUs) must not land beyond the opposite threshold, where the next decision would undo
        it. Without them the thresholds alone decide."""
        c = self.cfg
        if n_active < 0 or n_idle < 0:
            raise ValueError(f"replica counts must be >= 0, got n_active={n_active} n_idle={n_idle}")
        if not (math.isfinite(t_train_s) and math.isfinite(t_rollout_s)) or t_train_s < 0 or t_rollout_s < 0:
            return Decision("hold", 0, "no valid time measurement")
        cooling = steps_since_change is not None and steps_since_change < c.cooldown_steps
        # Protection comes first (an overloaded rollout side is an emergency) but waits out the cooldown after a
        # release: the pressure a release relieves falls only once its servers have started and the queue has
        # drained, so a release per step on the same pressure overshoots (DAPO-Math at 128 x 16: releases at
        # steps 2, 3 and 4 took training from 28 to 16 GPUs, whose 1,330-1,580 s steps lasted until step 14).
        # After a join that starved rollout it acts at once.
        # It is an emergency only while rollout holds the trainer up (T_rollout > T_train: the trainer waited): a
        # full pool the trainer never waits for is rollout running ahead, as the staleness bound lets it.
        if rollout_pressure >= c.protect_pressure and not (cooling and after_release) and t_rollout_s > t_train_s:
            if n_active > 0:
                n = min(n_active, c.max_release_per_decision)
                return Decision("release", n, f"rollout pressure {rollout_pressure:.2f} >= {c.protect_pressure:.2f}")
            return Decision("hold", 0, f"rollout pressure {rollout_pressure:.2f} high, nothing to release")
        if cooling:
            return Decision("hold", 0, f"cooldown {steps_since_change}/{c.cooldown_steps} steps")
        if t_rollout_s == 0:
            return Decision("hold", 0, "rollout time is zero")
        ratio = t_train_s / t_rollout_s
        if ratio >= c.join_ratio:
            if n_idle > 0:
                n = min(n_idle, c.max_join_per_decision)
                after = _projected(ratio, train_replicas, rollout_gpus, unit_gpus, n)
                if after is not None and after <= c.release_ratio:
                    return Decision("hold", 0, f"T_train/T_rollout {ratio:.2f} high, but {after:.2f} after joining "
                                    f"{n} would be <= {c.release_ratio:.2f}")
                return Decision("join", n, f"T_train/T_rollout {ratio:.2f} >= {c.join_ratio:.2f}")
            return Decision("hold", 0, f"T_train/T_rollout {ratio:.2f} high, no idle hybrid replica")
        if ratio <= c.release_ratio:
            if n_active > 0:
                n = min(n_active, c.max_release_per_decision)
                after = _projected(ratio, train_replicas, rollout_gpus, unit_gpus, -n)
                if after is not None and after >= c.join_ratio:
                    return Decision("hold", 0, f"T_train/T_rollout {ratio:.2f} low, but {after:.2f} after releasing "
                                    f"{n} would be >= {c.join_ratio:.2f}")
                return Decision("release", n, f"T_train/T_rollout {ratio:.2f} <= {c.release_ratio:.2f}")
            return Decision("hold", 0, f"T_train/T_rollout {ratio:.2f} low, no active hybrid replica")
        return Decision("hold", 0, f"T_train/T_rollout {ratio:.2f} inside hysteresis band")

    def request_from_plan(
        self, plan: Any, n_active: int, n_idle: int, core_dp: int | None = None
    ) -> Decision:
        """Turn the planner's target into a join/release request.

        `plan` is either an int (target number of active hybrid replicas) or a planner Plan: its
        `hybrid_replicas` attribute when it has one, else `plan.train.dp - core_dp` (hybrid replicas
        are the data-parallel replicas beyond the fixed core).
        """
        if isinstance(plan, int):
            target = plan
        elif getattr(plan, "hybrid_replicas", None) is not None:
            target = int(plan.hybrid_replicas)
        else:
            train = getattr(plan, "train", None)
            if train is None or core_dp is None:
                raise ValueError("plan needs .hybrid_replicas, or .train with core_dp given")
            dp = train.dp if hasattr(train, "dp") else train[2]
            target = int(dp) - int(core_dp)
        target = max(0, target)
        if target > n_active:
            n = min(target - n_active, n_idle)
            if n == 0:
                return Decision("hold", 0, f"plan wants {target} hybrid replicas, none idle")
            return Decision("join", n, f"plan wants {target} hybrid replicas, {n_active} active")
        if target < n_active:
            return Decision("release", n_active - target, f"plan wants {target} hybrid replicas, {n_active} active")
        return Decision("hold", 0, f"plan satisfied ({target} hybrid replicas)")


class ScheduledPolicy:
    """A fixed join/release script behind ElasticPolicy's interface (demonstrations, tests): from step
    `join_at_step` the idle (ready) hybrid replicas join training, once; `release_after` steps after they
    started training (None: never) they go back to rollout. Only the rollout-pressure protection of `cfg`
    still applies (the controller's); its verdicts are a script, not measurements, so the controller acts on
    them at once (no persistence filter)."""

    persist_verdicts = False

    def __init__(self, join_at_step: int, release_after: int | None = None, cfg: ElasticConfig | None = None) -> None:
        if join_at_step < 0 or (release_after is not None and release_after < 1):
            raise ValueError(f"need join_at_step >= 0 and release_after >= 1, got {join_at_step}, {release_after}")
        self.cfg = cfg or ElasticConfig()
        self.join_at_step, self.release_after = join_at_step, release_after
        self.training_since: int | None = None  # the first step the pool showed a hybrid training

    def decide(
        self,
        t_train_s: float,
        t_rollout_s: float,
        rollout_pressure: float,
        n_active: int,
        n_idle: int,
        steps_since_change: int | None = None,
        *,
        train_replicas: int | None = None,
        rollout_gpus: int | None = None,
        unit_gpus: int | None = None,
        step: int | None = None,
        after_release: bool = False,
    ) -> Decision:
        if step is None:
            return Decision("hold", 0, "the schedule needs the step")
        if n_active > 0 and self.training_since is None:
            self.training_since = step
        if n_active > 0 and rollout_pressure >= self.cfg.protect_pressure:  # as ElasticPolicy: rollout first
            n = min(n_active, self.cfg.max_release_per_decision)
            return Decision("release", n, f"rollout pressure {rollout_pressure:.2f} >= {self.cfg.protect_pressure:.2f}")
        if self.training_since is None:
            if step >= self.join_at_step and n_idle > 0:
                return Decision("join", n_idle, f"scheduled: join at step {self.join_at_step}")
            return Decision("hold", 0, f"scheduled: join at step {self.join_at_step}")
        if (self.release_after is not None and n_active > 0
                and step >= self.training_since + self.release_after):
            return Decision("release", n_active, f"scheduled: release {self.release_after} steps after "
                            f"training started (step {self.training_since})")
        return Decision("hold", 0, "scheduled")


def sizes_after(replicas: int, rollout_gpus: int, unit_gpus: int, delta: int) -> tuple[int, int] | None:
    """(training replicas, rollout GPUs) after `delta` replicas of `unit_gpus` GPUs join (> 0) or leave (< 0)
    training; None when either side is or would be empty. The one size rule of the pool's projections (this
    policy's, and `scaled_terms`: the prediction an elastic move records and the calibration on a moved pool)."""
    new_rep, new_roll = replicas + delta, rollout_gpus - delta * unit_gpus
    if min(replicas, rollout_gpus, new_rep, new_roll) < 1:
        return None
    return new_rep, new_roll


def scaled_terms(t_train_s: float, t_rollout_s: float, replicas: int, rollout_gpus: int, unit_gpus: int,
                 delta: int) -> tuple[float, float] | None:
    """Training and rollout times after `delta` replicas of `unit_gpus` GPUs join (> 0) or leave (< 0) training,
    from the times on `replicas` training replicas and `rollout_gpus` rollout GPUs: training scales with
    1/replicas, rollout with 1/rollout GPUs (this policy's projection, `_projected`, on times). None
    when a side is or would be empty. Used by the prediction an elastic move records
    (control.prediction.projected_step_s) and by the calibration of a plan on a pool that moved off it
    (LibraController._calibrate)."""
    after = sizes_after(replicas, rollout_gpus, unit_gpus, delta)
    if after is None:
        return None
    new_rep, new_roll = after
    return t_train_s * replicas / new_rep, t_rollout_s * rollout_gpus / new_roll


def _projected(ratio: float, replicas: int | None, rollout_gpus: int | None, unit_gpus: int | None,
               delta: int) -> float | None:
    """T_train/T_rollout after `delta` replicas join (> 0) or leave (< 0) training, assuming training time
    scales with 1/replicas and rollout time with 1/rollout GPUs; None when the sizes are not known or the
    move would empty a side."""
    if replicas is None or rollout_gpus is None or unit_gpus is None:
        return None
    after = sizes_after(replicas, rollout_gpus, unit_gpus, delta)
    if after is None:
        return None
    new_rep, new_roll = after
    return ratio * (replicas / new_rep) * (new_roll / rollout_gpus)


# ------------------------------------------------------------------ the pool's size, chosen with the plan
# The pipeline's fill: AReaL's trainer has nothing to train on until its first batch, so the first plan's hybrids
# serve rollout until then and join training, all at once, before the first step (the core's topology is not yet
# running). The simulator's pool (sim.libra.lend_in_fill) and the live one (live.elastic_live) both start so.
LEND_IN_FILL = True


def hybrid_count(train_dp: int, max_units: int, dp_div: int = 2) -> int:
    """How many of a plan's training data-parallel replicas are Elastic Hybrid Pool workers: at most
    `max_units`, never the last replica, and at most (dp - 1) // dp_div, so the core keeps more than half of the
    replicas with 2 and one release never halves the trainer (the simulator's Libra and the live pool sized
    with the plan both size it so)."""
    return max(0, min(int(max_units), (int(train_dp) - 1) // max(1, int(dp_div))))


def hybrid_server_tp(unit_gpus: int, bucket_tp: int) -> int:
    """The TP of the rollout servers a hybrid worker of `unit_gpus` accelerators runs while released: the
    largest power of two that fits the worker and does not exceed the TP of the bucket it serves."""
    return 1 << (max(1, min(int(bucket_tp), int(unit_gpus))).bit_length() - 1)
