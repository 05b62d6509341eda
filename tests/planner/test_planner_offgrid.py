"""RolloutDP.cost off the server-count grid (k > 64, or past its end when `fill` adds servers) prices the same
objective as the table: with the asynchronous window and the re-prefill term, the price is continuous and never
rises across the grid edge (it used to jump from 131.5 s at k=64 to 230.8 s at k=65 on a 1,024-GPU cluster)."""

import random

import numpy as np
import pytest

from areal_libra.cost.presets import load_cluster, load_model
from areal_libra.cost.rollout import RolloutCost
from areal_libra.planner.rollout_dp import RolloutDP


def _dp(window: float, reprefill: bool) -> RolloutDP:
    rng = random.Random(0)
    reqs = []
    for _ in range(24):
        p = rng.randint(100, 800)
        reqs.append((p, rng.randint(200, 6000)))
    reqs.sort(key=lambda r: r[0] + r[1])
    c = load_cluster("a800x1024")
    costs = {tp: RolloutCost(c.hardware, load_model("qwen3-14b"), tp, 256) for tp in (1, 2)}
    p = np.array([r[0] for r in reqs], float)
    o = np.array([r[1] for r in reqs], float)
    return RolloutDP(costs, p, o, np.full(len(p), 4096 / len(p)), 200, window=window, reprefill=reprefill)


@pytest.mark.parametrize("window,reprefill", [(5.0, True), (5.0, False), (1.0, True)])
def test_cost_is_monotone_and_continuous_across_the_grid_edge(window, reprefill):
    dp = _dp(window, reprefill)
    for tp in dp.tables:
        grid = dp.kgrid[tp]
        assert grid[-1] > 64  # the grid is sparse above 64: off-grid counts exist
        prices = [dp.cost(tp, k, 0, dp.n) for k in range(1, 200 // tp + 1)]
        # never rises with more servers
        assert all(b <= a for a, b in zip(prices, prices[1:]))
        # on the grid: the table itself
        for i, k in enumerate(grid):
            assert prices[k - 1] == pytest.approx(float(dp.tables[tp][i, dp.n * (dp.n - 1) // 2]))
        # one more server past the dense part changes the price by a few percent at most, not by 1.75x
        assert prices[64] >= 0.95 * prices[63]
        rc = dp.costs[tp]
        j = dp.n * (dp.n - 1) // 2
        k = 65 if 65 not in set(grid.tolist()) else 66
        want = float(rc.group_makespan_s(dp.W[j] / k, dp.mean_p[j], dp.mean_o[j], dp.max_o[j], dp.max_f[j],
                                         window=window, reprefill=reprefill))
        assert prices[k - 1] == pytest.approx(min(want, prices[k - 2]))
