"""Rollout DP vs exhaustive search on small random instances (<= 12 requests, <= 8 GPUs).

The exhaustive search shares nothing with the DP but the cost model: it recomputes each interval's
statistics in plain Python, calls RolloutCost.group_makespan_s itself and tries every split of the sorted
requests into contiguous intervals and every (TP, servers) per interval within the budget."""

import math
import random

import pytest

from areal_libra.cost.presets import load_hardware, load_model
from areal_libra.cost.rollout import RolloutCost
from areal_libra.planner.rollout_dp import RolloutDP

MODEL = load_model("qwen3-4b")
# A small-memory GPU so that long requests do not fit at TP1 and the TP choice matters.
HW = load_hardware("a800").replace(hbm_bytes=8e9 + 8.1e9 + 0.6e9)


def _cost_fn(costs, reqs, weights):
    cache = {}

    def cost(tp, k, a, b):
        key = (tp, k, a, b)
        if key not in cache:
            rc = costs[tp]
            ps, os_, ws = [r[0] for r in reqs[a:b]], [r[1] for r in reqs[a:b]], weights[a:b]
            W = sum(ws)
            mp = sum(w * p for w, p in zip(ws, ps)) / W
            mo = sum(w * o for w, o in zip(ws, os_)) / W
            if max(p + o for p, o in zip(ps, os_)) > rc.kv_capacity_tokens():
                cache[key] = math.inf
            else:
                n_req = max(W / k, min(1.0, W))
                cache[key] = float(rc.group_makespan_s(n_req, mp, mo, max(os_), max(p + o for p, o in zip(ps, os_))))
        return cache[key]

    return cost


def exhaustive(costs, reqs, weights, budget):
    cost = _cost_fn(costs, reqs, weights)
    n = len(reqs)
    best = math.inf

    def rec(i, left, worst):
        nonlocal best
        if worst >= best:
            return
        if i == n:
            best = worst
            return
        for j in range(i + 1, n + 1):
            for tp in costs:
                for k in range(1, left // tp + 1):
                    rec(j, left - tp * k, max(worst, cost(tp, k, i, j)))

    rec(0, budget, 0.0)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_dp_equals_exhaustive(seed):
    rng = random.Random(seed)
    n = 12 - seed if seed < 3 else rng.randint(1, 8)
    budget = rng.randint(1, 8)
    tps = rng.choice([(1, 2, 4, 8), (1, 2), (2, 4), (1, 4, 8)])
    costs = {tp: RolloutCost(HW, MODEL, tp, max_running=rng.choice([4, 16, 256])) for tp in tps}
    reqs = sorted(((rng.randint(10, 2000), rng.randint(1, rng.choice([500, 5000, 30000]))) for _ in range(n)),
                  key=lambda r: r[0] + r[1])
    weights = [rng.choice([0.5, 1.0, 2.0, 3.5]) for _ in range(n)]
    dp = RolloutDP(costs, [r[0] for r in reqs], [r[1] for r in reqs], weights, budget)
    sol = dp.best_within(budget)
    ref = exhaustive(costs, reqs, weights, budget)
    if math.isinf(ref):
        assert sol is None
        return
    assert sol is not None
    assert sol.t_s == pytest.approx(ref, rel=1e-12)
    assert sol.gpus <= budget
    # the solution covers every request exactly once, in order
    assert [g.lo for g in sol.groups] == [0] + [g.hi for g in sol.groups[:-1]] and sol.groups[-1].hi == n


def test_fill_spends_budget_without_slowing_down():
    rng = random.Random(7)
    costs = {tp: RolloutCost(HW, MODEL, tp) for tp in (1, 2, 4)}
    reqs = sorted(((rng.randint(10, 500), rng.randint(1, 8000)) for _ in range(10)), key=lambda r: sum(r))
    dp = RolloutDP(costs, [r[0] for r in reqs], [r[1] for r in reqs], [4.0] * 10, 24)
    sol = dp.best_within(6)
    filled, left = dp.fill(sol, 24)
    assert left == 0 and filled.gpus == 24
    assert filled.t_s <= sol.t_s


def test_native_probe_matches_numpy():
    """The C++ probe (when built) returns exactly what the numpy fallback returns."""
    from areal_libra.planner import rollout_dp

    if rollout_dp._native is None:
        pytest.skip("C++ extension not built (pure-Python fallback in use)")
    rng = random.Random(21)
    costs = {tp: RolloutCost(HW, MODEL, tp) for tp in (1, 2, 4, 8)}
    reqs = sorted(((rng.randint(10, 2000), rng.randint(1, 20000)) for _ in range(40)), key=lambda r: sum(r))
    dp = RolloutDP(costs, [r[0] for r in reqs], [r[1] for r in reqs], [rng.random() * 5 for _ in reqs], 1024)
    assert any(len(g) > 64 for g in dp.kgrid.values())  # the coarse part of the server-count grid is used
    cands = dp.candidates_between(0.0, math.inf)
    for T in list(cands[:: max(1, len(cands) // 50)]) + [0.0, float(cands[-1]) * 2]:
        g_py, groups_py = dp.min_gpus_py(float(T))
        g_c, groups_c = dp.min_gpus(float(T))
        assert g_py == g_c and groups_py == groups_c


def test_k_grid_and_off_grid_cost():
    from areal_libra.planner.rollout_dp import k_grid

    g = k_grid(1000)
    assert list(g[:64]) == list(range(1, 65)) and g[-1] == 1000 and all(b > a for a, b in zip(g, g[1:]))
    assert all(b / a <= 1.0625 + 1 / 64 for a, b in zip(g[64:], g[65:]))
    costs = {1: RolloutCost(HW, MODEL, 1)}
    dp = RolloutDP(costs, [100.0] * 3, [200.0, 300.0, 400.0], [100.0] * 3, 1000)
    assert 67 not in set(dp.kgrid[1]) or 71 not in set(dp.kgrid[1])
    for k in (1, 64, 67, 71, 300):  # on and off the grid: the same formula
        j = 3 * 2 // 2 + 0
        n_req = max(dp.W[j] / k, 1.0)
        want = float(costs[1].group_makespan_s(n_req, dp.mean_p[j], dp.mean_o[j], dp.max_o[j], dp.max_f[j]))
        assert dp.cost(1, k, 0, 3) == pytest.approx(want, rel=1e-12)


def test_monotone_tie_break_keeps_the_gpu_count():
    """monotone_groups meets the same target with exactly as many GPUs as min_gpus, every group within T."""
    for seed in range(15):
        rng = random.Random(100 + seed)
        n, budget = rng.randint(1, 20), rng.randint(1, 64)
        costs = {tp: RolloutCost(HW, MODEL, tp) for tp in rng.choice([(1, 2, 4, 8), (1, 2), (2, 4)])}
        reqs = sorted(((rng.randint(10, 2000), rng.randint(1, rng.choice([500, 5000, 30000]))) for _ in range(n)),
                      key=lambda r: r[0] + r[1])
        dp = RolloutDP(costs, [r[0] for r in reqs], [r[1] for r in reqs], [rng.choice([0.5, 2.0]) for _ in reqs],
                       budget)
        for T in dp.candidates_between(0.0, math.inf)[::5]:
            g, _ = dp.min_gpus(float(T))
            gm, groups = dp.monotone_groups(float(T))
            assert gm == g
            if groups:
                assert all(dp.cost(tp, k, a, b) <= T for a, b, tp, k in groups)
                assert sum(tp * k for _, _, tp, k in groups) == gm
