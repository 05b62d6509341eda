"""The asynchronous loop's servers priced at the concurrency its step sustains (PlannerConfig.sustained_concurrency):
Little's law over one batch per step, the step itself a fixed point of the prices."""

from dataclasses import replace

import numpy as np
import pytest

from areal_libra.cost.presets import load_cluster, load_model
from areal_libra.cost.rollout import RolloutCost
from areal_libra.planner import PlannerConfig, solve
from areal_libra.planner.evaluate import price

from .histories import tail_history


def _rc(tp=8):
    return RolloutCost(load_cluster("a800x48").hardware, load_model("qwen3-14b"), tp, 256)


def test_sustained_concurrency_is_the_smallest_that_keeps_up():
    rc = _rc()
    kv = 6000.0
    rate = 40.0 / float(rc.decode_step_s(40.0, 40.0 * kv))  # what 40 running requests decode per second
    c = float(rc.sustained_concurrency(rate, 200.0, kv))
    assert c == pytest.approx(40.0, rel=1e-3)
    assert (c - 0.5) / float(rc.decode_step_s(c - 0.5, (c - 0.5) * kv)) < rate
    # A rate no concurrency up to the cap reaches: the cap; a trickle: one request.
    assert float(rc.sustained_concurrency(1e9, 200.0, kv)) == 200.0
    assert float(rc.sustained_concurrency(1e-6, 200.0, kv)) == pytest.approx(1.0)
    # Vectorised like the planner's cost tables.
    out = rc.sustained_concurrency(np.array([rate, 1e9]), np.array([200.0, 50.0]), kv)
    assert out.shape == (2,) and out[0] == pytest.approx(40.0, rel=1e-3) and out[1] == 50.0


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_the_dense_closed_form_is_the_bisection(tp):
    # The dense model's step is affine in each regime (memory / compute bound), so sustained_concurrency solves
    # it exactly; a plain bisection on decode_step_s is the definition it must agree with, in both regimes and
    # at both clips (one request, the cap).
    rc = _rc(tp)
    rng = np.random.default_rng(tp)
    rate, conc, kv = 10 ** rng.uniform(-1, 5, 500), rng.uniform(1, 256, 500), 10 ** rng.uniform(2, 4.6, 500)
    lo, hi = np.ones(500), conc.copy()
    for _ in range(60):
        mid = (lo + hi) / 2.0
        ok = mid / rc.decode_step_s(mid, mid * kv) >= rate
        hi, lo = np.where(ok, mid, hi), np.where(ok, lo, mid)
    got = rc.sustained_concurrency(rate, conc, kv)
    assert np.allclose(got, hi, rtol=1e-9)
    assert (got == 1.0).any() and (got == conc).any() and ((got > 1.0) & (got < conc)).any()


def test_a_slow_step_prices_the_critical_path_at_the_concurrency_it_sustains():
    rc = _rc()
    args = (40.0, 2000.0, 3000.0, 38000.0, 40000.0)  # a long-tailed interval: the critical path decides
    full = float(rc.group_makespan_s(*args, window=5.0))
    assert float(rc.group_makespan_s(*args, window=5.0, step_s=0.0)) == full  # unknown step: the window's
    # A loop stepping every 1,000 s needs a few requests running, not the window's 200: a faster straggler.
    slow = float(rc.group_makespan_s(*args, window=5.0, step_s=1000.0))
    assert slow < 0.7 * full
    # A step shorter than the servers can keep up with: the window's full concurrency, as before.
    assert float(rc.group_makespan_s(*args, window=5.0, step_s=1e-3)) == pytest.approx(full)
    # The synchronous objective ignores it.
    assert float(rc.group_makespan_s(*args, step_s=1000.0)) == float(rc.group_makespan_s(*args))


def _tail_history(seed=0, n=400):
    return tail_history(seed, n, (1500, 2500), (500, 6000), (20000, 38000), 0.04)


def test_solve_and_price_agree_on_the_sustained_step():
    h = _tail_history()
    # split="joint": the fixed point's own property, not the split rule's (which compares several solves)
    cfg = PlannerConfig(global_batch=128, mode="async", staleness=4, split="joint")
    on = solve("a800x48", "qwen3-14b", h, cfg)
    off = solve("a800x48", "qwen3-14b", h, replace(cfg, sustained_concurrency=False))
    # The window's full concurrency is the slowest way to price the servers: the fixed point is never slower.
    assert on.makespan_s <= off.makespan_s
    assert on.t_rollout_s < off.t_rollout_s
    # price() finds the same kind of fixed point for the plan: its step is within the sampling difference of
    # the plan's own, and below the full-concurrency price of the same plan.
    p_on = price(on, "a800x48", "qwen3-14b", h, cfg)
    p_off = price(on, "a800x48", "qwen3-14b", h, replace(cfg, sustained_concurrency=False))
    assert p_on.makespan_s == pytest.approx(on.makespan_s, rel=0.2)
    assert p_on.t_rollout_s <= p_off.t_rollout_s
    assert p_on.t_train_s == p_off.t_train_s
