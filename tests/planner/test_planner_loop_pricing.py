"""Pricing the asynchronous loop as it runs (issue 23 build 2): length-biased resident KV, the in-flight slot
statistics of GRPO groups, and the planner using both in solve and in price alike."""

import random
from dataclasses import replace

import numpy as np
import pytest

from areal_libra.control.prediction import layout_plan
from areal_libra.cost.presets import load_cluster, load_model
from areal_libra.cost.rollout import RolloutCost
from areal_libra.cost.training import TrainParallel
from areal_libra.planner import PlannerConfig, solve
from areal_libra.planner.evaluate import price
from areal_libra.planner.rollout_dp import RolloutDP
from areal_libra.planner.slots import slot_stats


def _rc(tp=8):
    return RolloutCost(load_cluster("a800x8").hardware, load_model("qwen3-14b"), tp, 256)


def _history(seed=0, n=400):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = rng.randint(100, 400)
        out.append((p, p + int(rng.lognormvariate(8.5, 0.8))))
    return out


def test_length_biased_resident_kv_prices_a_longer_running_batch():
    rc = _rc()
    args = (128.0, 150.0, 8000.0, 20000.0, 20150.0)
    base = float(rc.group_makespan_s(*args, window=5.0))
    assert float(rc.group_makespan_s(*args, window=5.0, resident_output=4000.0)) == pytest.approx(base)  # = mean/2
    biased = float(rc.group_makespan_s(*args, window=5.0, resident_output=6000.0))
    assert biased > base  # more KV per running request: slower decode steps, a longer re-prefill
    # sync mode reserves final lengths up front and ignores it
    assert float(rc.group_makespan_s(*args, resident_output=6000.0)) == float(rc.group_makespan_s(*args))


def test_rollout_dp_uses_each_intervals_second_moment():
    rng = np.random.default_rng(3)
    o = np.sort(rng.lognormal(8.0, 0.9, 40))
    p = np.full(40, 200.0)
    w = np.full(40, 256 / 40)
    costs = {8: _rc(8)}
    dp = RolloutDP(costs, p, o, w, 16, window=5.0, length_biased=True)
    a, b, k = 5, 37, 2
    sel = slice(a, b)
    want_res = float((w[sel] * o[sel] ** 2).sum() / (2.0 * (w[sel] * o[sel]).sum()))
    n_req = w[sel].sum() / k
    want = float(costs[8].group_makespan_s(n_req, 200.0, float(o[sel].mean()), float(o[sel].max()),
                                           float(200.0 + o[sel].max()), window=5.0, resident_output=want_res))
    assert dp.cost(8, k, a, b) == pytest.approx(want, rel=1e-9)
    plain = RolloutDP(costs, p, o, w, 16, window=5.0)
    assert dp.cost(8, k, a, b) > plain.cost(8, k, a, b)


@pytest.mark.parametrize("slots", [{}, {"slot_output": 6000.0, "slot_wait_s": 20.0}])
def test_price_reproduces_the_async_plan(slots):
    hist = _history()
    cfg = PlannerConfig(global_batch=256, mode="async", staleness=4, **slots)
    plan = solve("a800x48", "qwen3-14b", hist, cfg)
    same = price(plan, "a800x48", "qwen3-14b", hist, cfg)
    assert same.t_rollout_s == pytest.approx(plan.t_rollout_s, rel=1e-6)
    assert same.t_train_s == pytest.approx(plan.t_train_s, rel=1e-12)


def test_slot_stats_are_expectations_over_groups():
    groups = [[(100, 0.0), (300, 2.0)], [(1000, 5.0), (200, 30.0)], []]
    out, wait = slot_stats(groups)
    assert out == pytest.approx((300 + 1000) / 2)
    assert wait == pytest.approx((2.0 + 30.0) / 2)
    assert slot_stats([]) == (None, 0.0)


def test_slots_replace_the_single_longest_request_and_price_tool_waits():
    rc = _rc(2)
    # A few long requests on an idle server: without slots the single longest sets the path.
    args = (4.0, 300.0, 3000.0, 30000.0, 30300.0)
    longest = float(rc.group_makespan_s(*args, window=5.0, reprefill=False))
    slot = float(rc.group_makespan_s(*args, window=5.0, reprefill=False, slot_output=6000.0))
    assert slot < longest
    # Tool waits held in a slot count once per window of eta + 1 batches (Little's law).
    waited = float(rc.group_makespan_s(*args, window=5.0, reprefill=False, slot_output=6000.0, slot_wait_s=500.0))
    assert waited - slot == pytest.approx(500.0 / 5.0, rel=1e-6)
    # Sync mode keeps the critical path of its own longest request.
    assert float(rc.group_makespan_s(*args, slot_output=6000.0)) == float(rc.group_makespan_s(*args))


def test_one_outlier_in_a_long_history_does_not_set_the_price():
    """The tail sample is one batch's expected longest request (the top n / (B + 1) of the history): one
    30,000-token outlier among 15 batches moves the price by < 5% (as the single longest it moved it 62%)."""
    rng = random.Random(5)
    big = [(200, 200 + int(rng.lognormvariate(7.5, 0.7))) for _ in range(128 * 15)]
    outlier = big[:-1] + [(200, 30200)]
    cfg = PlannerConfig(global_batch=128, mode="async", staleness=4)
    plan = solve("a800x48", "qwen3-14b", big[:128], cfg)
    a = price(plan, "a800x48", "qwen3-14b", big, cfg).t_rollout_s
    b = price(plan, "a800x48", "qwen3-14b", outlier, cfg).t_rollout_s
    assert b == pytest.approx(a, rel=0.05)


def test_evicted_reprefill_is_zero_while_the_working_set_fits():
    rc = _rc(2)
    cap = rc.kv_capacity_tokens()
    one = float(rc.prefill_s(5000.0))
    # 100 requests of a batch, 6 tool returns each; 400 in flight holding 10,000 tokens each.
    assert float(rc.evicted_reprefill_s(100.0, cap / 10_000.0, 10_000.0, 6.0, 5000.0)) == 0.0  # fits exactly
    # Twice the cache: half the returns find their context evicted and prefill it again.
    half = float(rc.evicted_reprefill_s(100.0, 2 * cap / 10_000.0, 10_000.0, 6.0, 5000.0))
    assert half == pytest.approx(100 * 6 * 0.5 * one)
    # More in flight: more misses; no tool returns: nothing to prefill again.
    assert float(rc.evicted_reprefill_s(100.0, 4 * cap / 10_000.0, 10_000.0, 6.0, 5000.0)) > half
    assert float(rc.evicted_reprefill_s(100.0, 4 * cap / 10_000.0, 10_000.0, 0.0, 5000.0)) == 0.0


def _agentic_history(seed=0, n=1000):
    """Long multi-turn contexts (R2E-Gym-like): 2-20k tokens generated after 1-4k of prompt."""
    rng = random.Random(seed)
    return [(p, p + rng.randint(2000, 20000)) for p in (rng.randint(1000, 4000) for _ in range(n))]


def test_unbounded_admission_prices_the_contexts_the_cache_evicts():
    h = _agentic_history()
    libra = PlannerConfig(global_batch=2048, mode="async", staleness=4)
    areal = PlannerConfig(global_batch=2048, mode="async", staleness=4, admission="unbounded", tool_returns=6.0)

    def rollout(roll, cfg):
        plan = layout_plan(roll, 2, TrainParallel(2, 1, (48 - roll) // 2), 40960)
        return price(plan, "a800x48", "qwen3-14b", h, cfg).t_rollout_s

    # Libra's admission keeps the working set in the cache: its price is the loop's as before; AReaL's loop
    # with 10,240 trajectories in flight overflows 8 or 16 TP2 servers and pays the evicted contexts again.
    for roll in (16, 32):
        assert rollout(roll, areal) > rollout(roll, libra)
    assert rollout(16, replace(areal, tool_returns=0.0)) == pytest.approx(rollout(16, libra))
    # The extra is larger where the cache is smaller: fewer rollout GPUs lose more to eviction.
    assert rollout(16, areal) / rollout(16, libra) > rollout(32, areal) / rollout(32, libra)
    # A concurrency cap (AReaL's max_concurrent_rollouts) shrinks the working set.
    assert rollout(16, replace(areal, max_in_flight=2048)) < rollout(16, areal)
    with pytest.raises(ValueError, match="admission"):
        PlannerConfig(admission="greedy")
