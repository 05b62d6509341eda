"""The in-flight slot statistics of an asynchronous RL loop's GRPO groups (issue 23 build 2).

With staleness eta at most eta + 1 batches of trajectories are in flight, and a trajectory's slot is held
until its whole group has finished. The planner prices that with two numbers from finished groups
(PlannerConfig.slot_output, slot_wait_s; RolloutCost.group_makespan_s): the expected generated tokens of a
group's longest member and the expected tool waits of its longest-waiting member. Both are expectations over
groups, not the single longest request of the history, so they do not grow with the history's size.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def slot_stats(groups: Iterable[Sequence[tuple[float, float]]]) -> tuple[float | None, float]:
    """(slot_output, slot_wait_s) from groups of (generated tokens, measured tool wait seconds) per member:
    E over groups of the members' maximum of each. (None, 0.0) when no group is given."""
    outs, waits = [], []
    for g in groups:
        if not g:
            continue
        outs.append(max(float(o) for o, _ in g))
        waits.append(max(float(w) for _, w in g))
    if not outs:
        return None, 0.0
    return sum(outs) / len(outs), sum(waits) / len(waits)
