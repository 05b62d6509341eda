"""Length drift over training steps, for C-MLFQ's `drift` switch.

During RL training the generated length of a prompt drifts from step to step (the policy learns to call
more tools, to reason longer). The prefix tree keeps the remaining lengths of earlier steps; when a prompt
comes back several steps later its history is stale by the drift in between. This module estimates a
per-step length level from *visible* steps only (the visibility rule: a step's own outcomes are unknown
while it runs) and extrapolates it to the step being routed:

    level(k) = exp(rate * (k - ref)),   ref = the newest visible step,

with `rate` the slope of log generated length (final length - prompt) against the step. Where prompts
recur, the slope is taken within prompts (each prompt's cells are demeaned), so the mix of easy and hard
prompts drawn in a step does not masquerade as drift; where no prompt was seen in two visible steps, the
slope of the per-step means is used instead. The policy stores remaining lengths divided by their step's
level and multiplies by the level of the routed step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from areal_libra.trace import Trajectory


class LengthDrift:
    def __init__(self, max_steps: int = 8, min_prompts: int = 4, max_rate: float = 0.5) -> None:
        if max_steps < 2 or min_prompts < 1 or max_rate <= 0:
            raise ValueError("need max_steps >= 2, min_prompts >= 1, max_rate > 0")
        self.max_steps = max_steps  # visible steps the slope is fitted on (the newest ones)
        self.min_prompts = min_prompts  # recurring prompts needed before the within-prompt slope is used
        self.max_rate = max_rate  # |rate| cap: a wild fit must not blow up the extrapolation
        self.rate = 0.0
        self.ref: int | None = None
        self.source = "none"  # which estimator produced `rate`: within_prompt, step_means or none
        # Validation only (scheduler/auto.py): a held-out step older than the fitted ones is routed as
        # itself, since its outcomes are not in the fit.
        self.past_ok = False
        # (prompt, step) -> [sum of generated tokens, count]; step -> [sum, count]
        self._cells: dict[tuple[str, int], list[int]] = {}
        self._steps: dict[int, list[int]] = {}

    def add(self, traj: Trajectory) -> None:
        """Record a trajectory of a step that has become visible (its outcome may now be used)."""
        gen = max(1, traj.final_length - traj.prompt_tokens)
        c = self._cells.setdefault((traj.prompt_id, traj.step), [0, 0])
        c[0] += gen
        c[1] += 1
        s = self._steps.setdefault(traj.step, [0, 0])
        s[0] += gen
        s[1] += 1

    def add_all(self, trajs: Iterable[Trajectory]) -> None:
        for t in trajs:
            self.add(t)

    def refit(self) -> None:
        """Re-estimate the rate on the newest `max_steps` visible steps (older cells are forgotten)."""
        if not self._steps:
            return
        keep = sorted(self._steps)[-self.max_steps:]
        lo = keep[0]
        self._steps = {k: self._steps[k] for k in keep}
        self._cells = {key: v for key, v in self._cells.items() if key[1] >= lo}
        self.ref = keep[-1]
        rate, self.source = self._within_prompt()
        if rate is None:
            rate, self.source = self._step_means()
        self.rate = max(-self.max_rate, min(self.max_rate, rate))

    def _within_prompt(self) -> tuple[float | None, str]:
        by_prompt: dict[str, list[tuple[int, float]]] = {}
        for (pid, step), (tot, n) in self._cells.items():
            by_prompt.setdefault(pid, []).append((step, math.log(tot / n)))
        sxy = sxx = 0.0
        used = 0
        for cells in by_prompt.values():
            if len(cells) < 2:
                continue
            mk = sum(k for k, _ in cells) / len(cells)
            my = sum(y for _, y in cells) / len(cells)
            sxy += sum((k - mk) * (y - my) for k, y in cells)
            sxx += sum((k - mk) ** 2 for k, _ in cells)
            used += 1
        if used < self.min_prompts or sxx <= 0:
            return None, "none"
        return sxy / sxx, "within_prompt"

    def _step_means(self) -> tuple[float, str]:
        pts = [(k, math.log(tot / n)) for k, (tot, n) in self._steps.items()]
        if len(pts) < 2:
            return 0.0, "none"
        mk = sum(k for k, _ in pts) / len(pts)
        my = sum(y for _, y in pts) / len(pts)
        sxx = sum((k - mk) ** 2 for k, _ in pts)
        return sum((k - mk) * (y - my) for k, y in pts) / sxx, "step_means"

    def routed_step(self, step: int) -> int:
        """The step a request is treated as: never one whose outcomes are already visible (a caller that
        does not tag steps, or tags them 0, is taken to run the step after the newest visible one)."""
        return step if self.ref is None or step > self.ref or self.past_ok else self.ref + 1

    def level(self, step: int) -> float:
        """Length level of `step` relative to the newest visible step (1.0 before anything is visible)."""
        if self.ref is None:
            return 1.0
        return math.exp(self.rate * (step - self.ref))


def routed_level(rate: float, ref: int, past_ok: bool, step: int) -> float:
    """LengthDrift.level(routed_step(step)) from its fitted parameters (ref set): what a request of `step` is
    scaled by. The tree cores compute it per decision (csrc/prefix_tree.cpp mirrors this arithmetic)."""
    routed = step if step > ref or past_ok else ref + 1
    return math.exp(rate * (routed - ref))


class GrowthTable:
    """Typical context growth (context at the k-th tool return minus the prompt) per prompt and depth, for
    C-MLFQ's `growth` switch: a sample that has grown faster than its prompt's earlier samples had at the
    same depth tends to keep doing so (a verbose sample stays verbose, a search that returned long
    passages keeps returning them; PolyTrace Search-R1 shows it, evaluation/synth_trace.py `persistence`).
    Values are stored divided by the caller's scale (the drift level), like the tree's. Bounded: the least
    recently updated prompts go first. This is the Python core's table and the reference for the C++ core's
    own (csrc/prefix_tree.cpp GrowthCore: same sums in the same order; PrefixTree.growth_table picks one)."""

    def __init__(self, max_prompts: int = 100_000, max_depth: int = 64) -> None:
        self.max_prompts = max_prompts
        self.max_depth = max_depth
        self._by_prompt: dict[str, list[list[float]]] = {}  # prompt -> per depth [sum, count]
        self._global: list[list[float]] = []

    def clear(self) -> None:
        self._by_prompt.clear()
        self._global.clear()

    @staticmethod
    def _add(rows: list[list[float]], depth: int, value: float) -> None:
        while len(rows) <= depth:
            rows.append([0.0, 0])
        rows[depth][0] += value
        rows[depth][1] += 1

    def add(self, prompt_id: str, prompt_tokens: int, contexts: list[int], scale: float = 1.0) -> None:
        """contexts: the trajectory's context at its start and after each tool return."""
        rows = self._by_prompt.pop(prompt_id, None)
        if rows is None:
            rows = []
            if len(self._by_prompt) >= self.max_prompts:
                del self._by_prompt[next(iter(self._by_prompt))]
        self._by_prompt[prompt_id] = rows  # re-inserted: most recently updated last
        for d in range(1, min(len(contexts), self.max_depth + 1)):
            v = (contexts[d] - prompt_tokens) / scale
            self._add(rows, d, v)
            self._add(self._global, d, v)

    def typical(self, prompt_id: str, depth: int) -> float | None:
        """Mean growth at `depth` over the prompt's samples that reached it (else over all prompts)."""
        for rows in (self._by_prompt.get(prompt_id), self._global):
            if rows is not None and depth < len(rows) and rows[depth][1] > 0:
                return rows[depth][0] / rows[depth][1]
        return None


def growth_factor(grown: float, typical: float | None, exponent: float, cap: float = 4.0) -> float:
    """(grown / typical) ** exponent, the ratio clipped to [1/cap, cap]; 1 when nothing is known."""
    if exponent == 0 or typical is None or typical <= 0 or grown <= 0:
        return 1.0
    return min(cap, max(1.0 / cap, grown / typical)) ** exponent
