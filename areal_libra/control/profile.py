"""The profiling pass and the first plan, written once for the simulator and the live run.

Before step 1 Libra runs the initial policy on `groups` prompts, every member of every group to its end (the
long tail included), and solves its first plan on all of those trajectories; the controller then starts
from that plan (`LibraController.from_profile`). The simulator's pass is its workload's profile
(`sim.libra.libra_system`: `Workload.profile`, plus the profile's own draw seed); the live run's is the same
number of groups played through the real rollout path before training starts (`live.train.profile_pass`:
AReaL's `rollout_batch`, which returns only when every group finished), its trajectories handed to a
`ProfilePass` instead of the step metrics. A plan solved on whatever finishes first while batches are in
flight is biased to the short trajectories (docs/live.md, the decision agreement at 64 x H200): here the
first solve waits for the whole pass.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

PROFILE_GROUPS = 16  # prompts (GRPO groups) of the initial policy a profiling pass runs


class ProfileError(ValueError):
    """A profiling pass that cannot give a first plan (one line for the user)."""


@dataclass
class ProfilePass:
    """The trajectories of one profiling pass: `groups` groups of `group_size` members, collected as they finish
    (any object with prompt_tokens and final_length, and model_tokens for the triples history)."""

    groups: int = PROFILE_GROUPS
    group_size: int = 1
    trajectories: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.groups < 1 or self.group_size < 1:
            raise ProfileError(f"a profiling pass needs groups >= 1 and group_size >= 1, got {self.groups}, "
                               f"{self.group_size}")

    @property
    def expected(self) -> int:
        return self.groups * self.group_size

    def add(self, traj: Any) -> None:
        self.trajectories.append(traj)

    def extend(self, trajs: Iterable[Any]) -> ProfilePass:
        self.trajectories.extend(trajs)
        return self

    @property
    def complete(self) -> bool:
        return len(self.trajectories) >= self.expected

    def history(self, triples: bool = False, partial: bool = False) -> list[tuple[int, ...]]:
        """The planner's length history: (prompt_tokens, final_length) of every trajectory of the pass, or
        (prompt, final, model_tokens) with `triples`. ProfileError while the pass is incomplete (the first plan
        waits for the tail) unless `partial`, and when it holds nothing."""
        n = len(self.trajectories)
        if not n or (not partial and n < self.expected):
            raise ProfileError(f"the profiling pass finished {n} of {self.expected} trajectories "
                               f"({self.groups} groups x {self.group_size}); the first plan needs all of them")
        return length_history(self.trajectories, triples)

    def summary(self) -> str:
        n = len(self.trajectories)
        lens = sorted(int(t.final_length) for t in self.trajectories)
        tail = f"; final lengths median {lens[n // 2]}, max {lens[-1]}" if n else ""
        return (f"{n} of {self.expected} trajectories ({self.groups} groups x {self.group_size}) of the initial "
                f"policy{tail}")


def length_history(trajs: Iterable[Any], triples: bool = False) -> list[tuple[int, ...]]:
    """The planner's length history of finished trajectories: (prompt_tokens, final_length) each, or
    (prompt, final, model_tokens) with `triples`."""
    if triples:
        return [(int(t.prompt_tokens), int(t.final_length), int(t.model_tokens)) for t in trajs]
    return [(int(t.prompt_tokens), int(t.final_length)) for t in trajs]


def train_batch_lens(trajs: Iterable[Any], batch: int) -> tuple[int, ...] | None:
    """The batch the profiling pass times one training step on: the profile's final lengths tiled to the run's
    global batch (`batch` trajectories), as a user times a training step on the run's own data before training.
    The planner's training efficiency is fitted to that time (cost.calibrate.Calibration.add_train); None
    without trajectories."""
    lens = [int(t.final_length) for t in trajs]
    if not lens or batch < 1:
        return None
    return tuple(lens[i % len(lens)] for i in range(batch))


def first_plan(planner: Any, profile: ProfilePass, triples: bool = False, partial: bool = False) -> Any:
    """The first plan: the planner (a control.PlanSource) solved once on the whole profiling pass."""
    return planner.solve(profile.history(triples=triples, partial=partial))
