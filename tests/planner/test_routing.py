"""PlannerConfig.routing: a length-blind router gives every rollout GPU the same share of the whole length
distribution, so the planner plans one TP for it; a length-aware one keeps the mix the rollout DP prices."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from areal_libra.planner import PlanError, PlannerConfig, solve
from tests.cost.test_detect_cluster import QWEN3_1_7B
from tests.planner.histories import tail_history

CFG = PlannerConfig(global_batch=128, mode="async", staleness=4)


def _history():
    return tail_history(1, 400, (1500, 2500), (500, 6000), (20000, 38000), 0.02)


def test_a_blind_router_gets_the_best_single_tp_plan_where_a_length_router_gets_a_mix():
    h = _history()
    by_length = solve("a800x48", "qwen3-14b", h, CFG)
    assert len({i.tp for i in by_length.instances if not i.filler}) > 1
    singles = [solve("a800x48", "qwen3-14b", h, replace(CFG, allowed_tp=(tp,))) for tp in (1, 2, 4, 8)]
    best = min(singles, key=lambda p: p.makespan_s)
    blind = solve("a800x48", "qwen3-14b", h, replace(CFG, routing="blind"))
    assert blind.makespan_s == best.makespan_s
    assert (blind.train_gpus, blind.rollout_gpus) == (best.train_gpus, best.rollout_gpus)
    assert [(i.tp, i.count, i.max_len) for i in blind.instances] == [(i.tp, i.count, i.max_len) for i in best.instances]
    # One allowed TP: nothing to choose, the rule changes nothing.
    one = replace(CFG, allowed_tp=(4,))
    assert solve("a800x48", "qwen3-14b", h, replace(one, routing="blind")).makespan_s == singles[2].makespan_s


def test_a_blind_router_with_no_single_tp_that_fits_is_refused_by_name():
    # Neither TP1 nor TP2 holds a 200K-token context of this model.
    h = [(1000, 2000)] * 50 + [(1000, 200_000)] * 2
    with pytest.raises(PlanError, match="length-blind"):
        solve("a800x48", "qwen3-14b", h, replace(CFG, routing="blind", allowed_tp=(1, 2)))


def test_an_unknown_routing_is_refused_by_name():
    with pytest.raises(ValueError, match="routing"):
        PlannerConfig(routing="sorted")


@pytest.mark.parametrize("policy, routing", [("cmlfq", "by_length"), ("least_loaded", "blind"),
                                             ("round_robin", "blind"), ("mlfq", "by_length")])
def test_the_live_planner_prices_the_runs_dispatch_policy(tmp_path, policy, routing):
    from areal_libra.config import compose
    from areal_libra.live.live_cluster import plan_source

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_1_7B))
    c = compose(["cluster=gpu", "libra.control.cluster=h100x8", f"libra.scheduler.policy={policy}"])
    assert plan_source(c.libra, c.areal, str(tmp_path)).config.routing == routing
