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

A kept-up step has a second, tighter bound on its rollout: the time the rollout GPUs were busy in it (their
busy share x the interval). The decisions keep the looser one (train + wait), a deliberately conservative
price for taking GPUs from rollout: fitted to the busy time, the paper-scale R2E-Gym ladder re-planned towards
training and fell from 5,413 / 5,477 / 5,516 to 4,647 / 4,669 / 4,461 tokens/s on its first three Libra rungs.
A move's recorded prediction, the controller's estimate of the steps that follow, takes the tighter bound
(StepCalibration.prediction_factors).
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
        # measured/modelled rollout of the last `window` steps, each (waited: a bound, else an upper bound). One
        # window for both kinds: apart, the rarer waited steps outlived the window (on Search-R1 seed 2 five
        # waits over 30 steps counted against the last 10 others, and fitted a rollout factor of 1.45).
        self.roll: deque[tuple[bool, float]] = deque(maxlen=window)
        self.fixed: deque[float] = deque(maxlen=window)
        # the busy-time bound of the window's kept-up steps (measured/modelled), for predictions only
        self.roll_busy: deque[float] = deque(maxlen=window)
        self.factors = Factors()
        self.since_change = 0
        self.observed = 0

    @property
    def roll_bound(self) -> list[float]:
        """measured/modelled rollout on the window's steps where the trainer waited for rollout"""
        return [v for waited, v in self.roll if waited]

    @property
    def roll_upper(self) -> list[float]:
        """upper bounds of it from the window's steps where rollout kept up"""
        return [v for waited, v in self.roll if not waited]

    def _fitted_on_waits(self) -> bool:
        """The window holds enough waited steps (a `waited_frac` of it) to fit the rollout factor on them."""
        bound = self.roll_bound
        return bool(bound) and len(bound) >= self.waited_frac * len(self.roll)

    def prediction_factors(self) -> Factors:
        """The factors a prediction of the next steps uses: the fitted ones, except that a rollout factor only
        bounded from above by kept-up steps (too few waited steps to fit it) falls to the median of their busy-time
        bounds when that is tighter."""
        f = self.factors
        if not self.roll_busy or self._fitted_on_waits():
            return f
        return Factors(f.train, min(f.rollout, median(self.roll_busy)), f.fixed_s)

    def to_state(self) -> dict:
        """What a restarted run resumes from (JSON-able)."""
        return {"train": list(self.train), "roll": [[w, v] for w, v in self.roll], "fixed": list(self.fixed),
                "roll_busy": list(self.roll_busy),
                "factors": self.factors.as_dict(), "since_change": self.since_change, "observed": self.observed}

    def load_state(self, state: dict) -> None:
        """Continue from to_state(); KeyError/TypeError/ValueError on a malformed state."""
        for name in ("train", "fixed"):
            q = getattr(self, name)
            q.clear()
            q.extend(float(x) for x in state[name])
        self.roll.clear()
        if "roll" in state:
            self.roll.extend((bool(w), float(v)) for w, v in state["roll"])
        else:  # a state written with the two kinds apart: their order is lost, the window refills
            self.roll.extend([(True, float(v)) for v in state["roll_bound"]]
                             + [(False, float(v)) for v in state["roll_upper"]])
        self.roll_busy.clear()
        self.roll_busy.extend(float(x) for x in state.get("roll_busy", ()))  # absent in older states: refills
        f = state["factors"]
        self.factors = Factors(float(f["train"]), float(f["rollout"]), float(f["fixed_s"]))
        self.since_change, self.observed = int(state["since_change"]), int(state["observed"])

    def layout_changed(self) -> None:
        """The plan in force changed: measurements of the old layout no longer describe it."""
        self.since_change = 0
        self.train.clear()
        self.roll.clear()
        self.roll_busy.clear()

    def observe(self, interval_s: float, train_s: float, wait_s: float, t_train_model: float,
                t_roll_model: float, fixed_s: float | None = None, busy_s: float | None = None) -> Factors:
        """One step: measured interval, training time and wait (already scaled to the model's batch when the
        caller normalises per token), the model's two terms, the step's unexplained time (default
        interval - train - wait) and, when measured, the rollout GPUs' busy time in the step (same scale)."""
        self.since_change += 1
        if self.since_change <= self.settle or t_train_model <= 0 or t_roll_model <= 0 or interval_s <= 0:
            return self.factors
        self.observed += 1
        self.train.append(train_s / t_train_model)
        self.fixed.append(max(0.0, interval_s - train_s - wait_s if fixed_s is None else fixed_s))
        waited = wait_s > self.wait_min * (train_s + wait_s)
        self.roll.append((waited, (train_s + wait_s) / t_roll_model))
        if not waited and busy_s is not None:
            self.roll_busy.append(min(train_s + wait_s, busy_s) / t_roll_model)
        rollout = self.factors.rollout
        upper = self.roll_upper
        if self._fitted_on_waits():
            rollout = median(self.roll_bound)
        elif upper:
            rollout = min(rollout, median(upper))
        self.factors = Factors(train=median(self.train), rollout=rollout, fixed_s=median(self.fixed))
        return self.factors
