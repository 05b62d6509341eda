"""Per-step metrics: one flat JSON object per training step in <log_dir>/metrics.jsonl.

The trainer commits AReaL's exported stats; finished trajectories (from the workflow's trajectory sink)
add throughput and tool counts; project components add their own keys through `add_source`.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from pathlib import Path

from areal_libra.trace import Trajectory
from areal_libra.utils import append_jsonl

# The task reward of the batch this step trained on (always present when a step trains); then the
# rollout-side mean of episodes that finished since the last step.
REWARD_KEYS = ("ppo_actor/task_reward/avg", "rollout/reward")


class StepMetrics:
    """Collects per-step numbers and appends them to metrics.jsonl when AReaL commits a step."""

    def __init__(self, path: str | Path, total_steps: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.total_steps = total_steps
        self._lock = threading.Lock()
        self._sources: list[Callable[[], dict]] = []
        self._hooks: list[Callable[[int, dict], dict]] = []
        self._reset()
        self._t_last = time.monotonic()
        self._t_start = self._t_last

    def start_clock(self) -> None:
        """The first step's time starts now: set-up before it that is no step's (the profiling pass before the
        first plan) is left out of step_time_s, as the simulator's profile is out of its steps."""
        with self._lock:
            self._t_last = time.monotonic()

    def _reset(self) -> None:
        self._n_traj = 0
        self._gen_tokens = 0
        self._tool_calls = 0
        self._tool_failures = 0
        self._tool_timeouts = 0
        self._reward_sum = 0.0
        self._n_reward = 0

    def add_source(self, fn: Callable[[], dict]) -> None:
        """fn() -> flat dict merged into every step's record (e.g. cmlfq/*, elastic/*)."""
        self._sources.append(fn)

    def add_step_hook(self, fn: Callable[[int, dict], dict]) -> None:
        """fn(step, record) -> flat dict merged into the record before it is written (the control loop reads
        the step's timings and adds plan/*)."""
        self._hooks.append(fn)

    def on_trajectory(self, traj: Trajectory) -> None:
        with self._lock:
            self._n_traj += 1
            self._gen_tokens += traj.model_tokens
            for tool in traj.tool_returns():
                self._tool_calls += 1
                self._tool_failures += tool.status == "failure"
                self._tool_timeouts += tool.status == "timeout"
            if traj.reward is not None:
                self._reward_sum += traj.reward
                self._n_reward += 1

    def on_commit(self, step: int, stats: dict) -> None:
        now = time.monotonic()
        with self._lock:
            dt = max(now - self._t_last, 1e-9)
            rec: dict = {"step": step + 1, "time_s": round(now - self._t_start, 3), "step_time_s": round(dt, 4)}
            if self.total_steps:
                rec["total_steps"] = self.total_steps
            reward = next((stats[k] for k in REWARD_KEYS if k in stats), None)
            if reward is None and self._n_reward:
                reward = self._reward_sum / self._n_reward
            rec["reward"] = reward
            rec["trajectories"] = self._n_traj
            rec["gen_tokens"] = self._gen_tokens
            rec["throughput_tokens_per_s"] = round(self._gen_tokens / dt, 3)
            rec["tool_calls"] = self._tool_calls
            rec["tool_failures"] = self._tool_failures
            rec["tool_timeouts"] = self._tool_timeouts
            self._reset()
            self._t_last = now
        for src in self._sources:
            rec.update(src())
        for k, v in stats.items():
            if isinstance(v, (int, float)) and math.isfinite(float(v)):
                rec.setdefault(k, v)
        for hook in self._hooks:
            rec.update(hook(rec["step"], rec))
        append_jsonl(self.path, rec)
