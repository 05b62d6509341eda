"""Online per-term calibration of the Cost Evaluator from measured step records (issue 23 build 3).

Every step the plan in force is priced by the uncalibrated evaluator on the current history and put next
to what the step measured. Three factors, medians over the steps since the layout last changed (a few
settle steps skipped), so one slow step or one step's completion order does not move them:

- `train`: measured training time / modelled T_train.
- `rollout`: measured T_rollout (train + the trainer's wait) / modelled T_rollout, from the steps where the
  trainer waited for rollout. A step where rollout kept up only bounds it from above (T_rollout <= train +
  wait): then the factor may only fall to that bound, never rise.
- `fixed_s`: the per-step time neither side explains (interval - train - wait: the weight update, the
  optimizer's sync), added to every prediction.

The factors go into PlannerConfig.train_factor / rollout_factor, used by solve and by price alike, so a
term measured slower than modelled moves GPUs to it and can change which plan wins.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from statistics import median


@dataclass(frozen=True)
class Factors:
    train: float = 1.0
    rollout: float = 1.0
    fixed_s: float = 0.0

    def step_s(self, t_train_s: float, t_rollout_s: float) -> float:
        """A step's predicted time from the uncalibrated model's two terms."""
        return max(self.train * t_train_s, self.rollout * t_rollout_s) + self.fixed_s

    def as_dict(self) -> dict[str, float]:
        return {"train": round(self.train, 4), "rollout": round(self.rollout, 4), "fixed_s": round(self.fixed_s, 3)}


class StepCalibration:
    """Fits Factors from (measured step, modelled terms of the plan in force) pairs."""

    def __init__(self, window: int = 10, settle: int = 2, waited_frac: float = 1 / 3, wait_min: float = 0.05) -> None:
        """`window`: steps the medians run over; `settle`: steps skipped after a layout change; a step counts as
        rollout-bound when the trainer waited more than `wait_min` of the interval, and the rollout factor is
        fitted from those once they are at least `waited_frac` of the window."""
        self.window, self.settle, self.waited_frac, self.wait_min = window, settle, waited_frac, wait_min
        self.train: deque[float] = deque(maxlen=window)
        self.roll_bound: deque[float] = deque(maxlen=window)  # measured/modelled rollout on waited steps
        self.roll_upper: deque[float] = deque(maxlen=window)  # upper bounds from steps where rollout kept up
        self.fixed: deque[float] = deque(maxlen=window)
        self.factors = Factors()
        self.since_change = 0
        self.observed = 0

    def to_state(self) -> dict:
        """What a restarted run resumes from (JSON-able)."""
        return {"train": list(self.train), "roll_bound": list(self.roll_bound), "roll_upper": list(self.roll_upper),
                "fixed": list(self.fixed), "factors": self.factors.as_dict(), "since_change": self.since_change,
                "observed": self.observed}

    def load_state(self, state: dict) -> None:
        """Continue from to_state(); KeyError/TypeError/ValueError on a malformed state."""
        for name in ("train", "roll_bound", "roll_upper", "fixed"):
            q = getattr(self, name)
            q.clear()
            q.extend(float(x) for x in state[name])
        f = state["factors"]
        self.factors = Factors(float(f["train"]), float(f["rollout"]), float(f["fixed_s"]))
        self.since_change, self.observed = int(state["since_change"]), int(state["observed"])

    def layout_changed(self) -> None:
        """The plan in force changed: measurements of the old layout no longer describe it."""
        self.since_change = 0
        self.train.clear()
        self.roll_bound.clear()
        self.roll_upper.clear()

    def observe(self, interval_s: float, train_s: float, wait_s: float, t_train_model: float,
                t_roll_model: float, fixed_s: float | None = None) -> Factors:
        """One step: measured interval, training time and wait (already scaled to the model's batch when the
        caller normalises per token), the model's two terms, and the step's unexplained time (default
        interval - train - wait)."""
        self.since_change += 1
        if self.since_change <= self.settle or t_train_model <= 0 or t_roll_model <= 0 or interval_s <= 0:
            return self.factors
        self.observed += 1
        self.train.append(train_s / t_train_model)
        self.fixed.append(max(0.0, interval_s - train_s - wait_s if fixed_s is None else fixed_s))
        roll_meas = (train_s + wait_s) / t_roll_model
        if wait_s > self.wait_min * (train_s + wait_s):
            self.roll_bound.append(roll_meas)
        else:
            self.roll_upper.append(roll_meas)
        rollout = self.factors.rollout
        n = len(self.roll_bound) + len(self.roll_upper)
        if self.roll_bound and len(self.roll_bound) >= self.waited_frac * n:
            rollout = median(self.roll_bound)
        elif self.roll_upper:
            rollout = min(rollout, median(self.roll_upper))
        self.factors = Factors(train=median(self.train), rollout=rollout, fixed_s=median(self.fixed))
        return self.factors
