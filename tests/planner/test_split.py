"""PlannerConfig.split: the train/rollout split of a mixed plan is the best single-TP plan's."""

from dataclasses import replace

import pytest

from areal_libra.planner import PlannerConfig, solve
from tests.planner.histories import tail_history

CFG = PlannerConfig(global_batch=128, mode="async", staleness=4)


def _history():
    return tail_history(1, 400, (1500, 2500), (500, 6000), (20000, 38000), 0.02)


def test_a_mix_is_solved_within_the_split_of_the_best_single_tp_plan():
    h = _history()
    joint = solve("a800x48", "qwen3-14b", h, replace(CFG, split="joint"))
    singles = [solve("a800x48", "qwen3-14b", h, replace(CFG, allowed_tp=(tp,))) for tp in (1, 2, 4, 8)]
    best_single = min(singles, key=lambda p: p.makespan_s)
    plan = solve("a800x48", "qwen3-14b", h, CFG)
    # Priced jointly, the mix's optimistic rollout price takes training GPUs; the rule keeps the single-TP split.
    assert joint.train_gpus != best_single.train_gpus
    assert plan.train_gpus == best_single.train_gpus
    # Within that budget a mix still serves rollout where it beats the single TP.
    assert len({i.tp for i in plan.instances}) > 1
    assert plan.makespan_s <= best_single.makespan_s


def test_an_unknown_split_rule_is_refused_by_name():
    with pytest.raises(ValueError, match="split"):
        PlannerConfig(split="greedy")
