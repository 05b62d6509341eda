"""Re-plan policy: when to re-solve, and whether a new plan is worth applying.

Triggers: every `every_k` steps; early when the rollout queue or the active rollout capacity is under
pressure, or when predicted rollout and training times drift apart by `ratio` (either way round: a
training-bound split is as wrong as a rollout-bound one). Gate: apply only if the gain over the
horizon beats the reconfiguration cost, (T_cur - T_new) * horizon_steps - cost > 0, and the relative
gain is at least `min_gain`. Public Libra defaults: K=10, 0.75, 0.85, 1.25, 5%, 15 s.

`ReplanConfig` is declared once: the controller's `ControlConfig.replan_policy`, i.e. `libra.control.replan_policy`
in a live run (areal_libra.config); the simulator sets its own gate cost on it (areal_libra.sim.libra).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReplanConfig:
    every_k: int = 10  # re-plan period in steps (the paper's K)
    queue_pressure: float = 0.75
    active_pressure: float = 0.85
    ratio: float = 1.25
    min_gain: float = 0.05
    reconfig_cost_s: float = 15.0  # what the gate charges for one reconfiguration (a live CPU run's)
    horizon_steps: int = 1  # steps the new plan is credited with in the gate
    cooldown_steps: int = 5  # minimum steps between two early (non-periodic) triggers

    def __post_init__(self) -> None:
        if self.every_k < 1:
            raise ValueError(f"every_k must be >= 1, got {self.every_k}")
        if self.ratio < 1:
            raise ValueError(f"ratio must be >= 1, got {self.ratio}")
        if self.horizon_steps < 1:
            raise ValueError(f"horizon_steps must be >= 1, got {self.horizon_steps}")
        if self.reconfig_cost_s < 0 or self.cooldown_steps < 0:
            raise ValueError("reconfig_cost_s and cooldown_steps must be >= 0")


class ReplanPolicy:
    def __init__(self, cfg: ReplanConfig | None = None) -> None:
        self.cfg = cfg or ReplanConfig()
        self.last_trigger: int | None = None
        self.last_reason: str = ""

    def should_replan(self, step: int, queue_pressure: float = 0.0, active_pressure: float = 0.0,
                      t_rollout_s: float = 0.0, t_train_s: float = 0.0) -> bool:
        """True when step is a periodic re-plan point or an early trigger fires; the reason is kept in
        `last_reason`."""
        c = self.cfg
        reason = ""
        if step > 0 and step % c.every_k == 0:
            reason = f"periodic (every {c.every_k} steps)"
        elif self.last_trigger is None or step - self.last_trigger > c.cooldown_steps:
            if queue_pressure >= c.queue_pressure:
                reason = f"queue pressure {queue_pressure:.2f} >= {c.queue_pressure}"
            elif active_pressure >= c.active_pressure:
                reason = f"active rollout pressure {active_pressure:.2f} >= {c.active_pressure}"
            elif t_rollout_s > 0 and t_train_s > 0:
                r = max(t_rollout_s / t_train_s, t_train_s / t_rollout_s)
                if r >= c.ratio:
                    reason = f"rollout/train time ratio {t_rollout_s / t_train_s:.2f} outside [1/{c.ratio}, {c.ratio}]"
        if reason:
            self.last_trigger = step
            self.last_reason = reason
        return bool(reason)

    def accept(self, t_cur_s: float, t_new_s: float, reconfig_cost_s: float | None = None,
               horizon_steps: int | None = None) -> bool:
        """Apply the new plan only if (T_cur - T_new) * horizon - cost > 0 and the gain is >= min_gain of T_cur;
        `horizon_steps` (None: the configured one) caps the credit, e.g. at the steps a run has left."""
        cost = self.cfg.reconfig_cost_s if reconfig_cost_s is None else reconfig_cost_s
        horizon = self.cfg.horizon_steps if horizon_steps is None else horizon_steps
        gain = t_cur_s - t_new_s
        if t_cur_s <= 0 or gain <= 0:
            return False
        return gain * horizon - cost > 0 and gain / t_cur_s >= self.cfg.min_gain
