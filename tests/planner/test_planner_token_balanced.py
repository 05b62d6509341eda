"""Token-balanced training layouts (issue 23 build 4): DP need not divide the global batch, as in AReaL's
trainer; the cost model spreads tokens evenly over ranks, and the planner can pick such layouts."""

import random

import pytest

from areal_libra.cost.presets import load_cluster, load_model
from areal_libra.cost.training import BatchStats, TrainCost, TrainParallel
from areal_libra.planner import PlannerConfig, solve
from areal_libra.planner.train_tree import TreeConfig, exhaustive, search

Q14 = load_model("qwen3-14b")


def test_dp_that_does_not_divide_the_batch_is_priced_by_tokens():
    tc = TrainCost(load_cluster("a800x48"), Q14)
    lens = [4000] * 128
    t12 = tc.step_time_s(TrainParallel(2, 1, 12), lens)  # 128 / 12 is not an integer
    t8 = tc.step_time_s(TrainParallel(2, 1, 8), lens)
    t16 = tc.step_time_s(TrainParallel(2, 1, 16), lens)
    assert t16 < t12 < t8  # more replicas, less per-rank work, whatever divides what
    # the busiest rank runs ceil(128 / 12) = 11 micro-batches of its token share
    assert tc.breakdown(TrainParallel(2, 1, 12), lens)["micro_batches"] == 11
    # a batch DP divides is priced exactly as before: n / dp micro-batches of n / dp sequences' tokens
    b = tc.breakdown(TrainParallel(2, 1, 8), lens)
    assert b["micro_batches"] == 16


def test_tree_matches_exhaustive_on_non_dividing_sizes():
    c = load_cluster("a800x48")
    tc = TrainCost(c, Q14)
    rng = random.Random(1)
    st = BatchStats.of([rng.randint(500, 12000) for _ in range(128)])
    cfg = TreeConfig()
    for g in (12, 20, 24, 28, 40):
        res = search(tc, g, st, cfg)
        best, t = exhaustive(tc, g, st, cfg)
        assert res.best is not None and res.best.gpus == g
        assert res.t_s == pytest.approx(t)


def test_planner_can_train_on_24_gpus_with_a_batch_of_128():
    h = [(500, 500 + random.Random(i).randint(1000, 8000)) for i in range(256)]
    cfg = PlannerConfig(global_batch=128, min_train_gpus=24, max_train_gpus=24)
    p = solve("a800x48", "qwen3-14b", h, cfg)  # used to fail: "no training size in 24..24 GPUs admits a layout"
    assert p.train.gpus == 24
    assert 128 % p.train.dp != 0  # every 24-GPU layout has such a DP (24, 12, 6 or 3)


def test_rollout_budget_is_filled_with_a_smaller_tp():
    """A TP8-only plan on 28 rollout GPUs used to leave 4 idle; they now serve as smaller-TP servers in the
    slowest group's bucket, and fill_tp=() keeps the old behaviour."""
    h = [(500, 500 + random.Random(i).randint(1000, 8000)) for i in range(256)]
    base = dict(global_batch=128, min_train_gpus=20, max_train_gpus=20, allowed_tp=(8,))
    old = solve("a800x48", "qwen3-14b", h, PlannerConfig(fill_tp=(), **base))
    assert old.rollout_gpus == 24 and old.idle_gpus == 4
    p = solve("a800x48", "qwen3-14b", h, PlannerConfig(**base))
    assert p.idle_gpus == 0 and p.rollout_gpus + p.train.gpus == 48
    assert dict(p.tp_counts()) == {4: 1, 8: 3}
    assert len(p.buckets()) == len(old.buckets())  # same buckets: the filler serves the slowest group's
    assert p.t_rollout_s == old.t_rollout_s  # priced conservatively (extra capacity only)
