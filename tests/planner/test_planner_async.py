"""The planner's asynchronous (staleness-bounded) rollout objective and bucket thresholds."""


import numpy as np
import pytest

from areal_libra.cost.presets import load_cluster, load_model
from areal_libra.cost.rollout import RolloutCost
from areal_libra.planner import PlanError, PlannerConfig, solve
from areal_libra.planner.evaluate import price
from areal_libra.planner.types import Plan, RolloutInstance

from .histories import tail_history


def _history(seed=0, n=300):
    return tail_history(seed, n, (100, 800), (200, 3000), (20000, 30000), 0.05)


def test_async_cost_scales_the_critical_path_and_keeps_sync_default():
    c = load_cluster("a800x8")
    rc = RolloutCost(c.hardware, load_model("qwen3-14b"), 1, 256)
    # One very long request alone: the critical path decides; async pays it over the window.
    sync = float(rc.group_makespan_s(1.0, 500.0, 20000.0, 20000.0, 20500.0))
    assert float(rc.group_makespan_s(1.0, 500.0, 20000.0, 20000.0, 20500.0, window=1.0)) == sync
    a5 = float(rc.group_makespan_s(1.0, 500.0, 20000.0, 20000.0, 20500.0, window=5.0))
    assert a5 < sync / 2
    # Many short requests: throughput decides, and async (more in flight, no up-front reservation) is no slower
    # before the re-prefill after each weight update (priced separately, see the test below).
    s = float(rc.group_makespan_s(400.0, 500.0, 1500.0, 3000.0, 3500.0))
    a = float(rc.group_makespan_s(400.0, 500.0, 1500.0, 3000.0, 3500.0, window=5.0, reprefill=False))
    assert a <= s


def test_async_plan_is_priced_consistently_and_no_slower():
    h = _history()
    sync = solve("a800x48", "qwen3-14b", h, PlannerConfig(global_batch=256))
    asy = solve("a800x48", "qwen3-14b", h, PlannerConfig(global_batch=256, mode="async", staleness=4))
    assert asy.t_rollout_s < sync.t_rollout_s
    cfg = PlannerConfig(global_batch=256, mode="async", staleness=4)
    # The async plan priced on its own history under the same objective reproduces its rollout estimate
    # to within the sampling difference of the pricing path.
    p = price(asy, "a800x48", "qwen3-14b", h, cfg)
    assert p.t_rollout_s == pytest.approx(asy.t_rollout_s, rel=0.35)
    assert np.isfinite(p.makespan_s)
    # staleness 0 in async mode is exactly the sync objective (one batch in flight, KV reserved up front).
    a0 = solve("a800x48", "qwen3-14b", h, PlannerConfig(global_batch=256, mode="async", staleness=0))
    assert a0.t_rollout_s == pytest.approx(sync.t_rollout_s)


@pytest.mark.parametrize("cfg,needle", [(PlannerConfig(mode="fast"), "mode"),
                                         (PlannerConfig(mode="async", staleness=-1), "staleness")])
def test_bad_mode(cfg, needle):
    with pytest.raises(PlanError, match=needle):
        solve("a800x48", "qwen3-14b", _history(), cfg)


def test_buckets_never_repeat_a_threshold():
    from areal_libra.cost.training import TrainParallel

    inst = [RolloutInstance(1, 4, 2000), RolloutInstance(2, 2, 2000), RolloutInstance(4, 1, 9000),
            RolloutInstance(8, 1, 9000)]
    plan = Plan(TrainParallel(1, 1, 8), 24, inst, 1.0, 1.0, 1.0, 0.0)
    assert plan.buckets() == [(2000, 2), (9000, 8)]


def test_async_reprefill_after_weight_update_is_priced_and_moves_gpus_to_rollout():
    c = load_cluster("a800x8")
    rc = RolloutCost(c.hardware, load_model("qwen3-14b"), 1, 256)
    args = (40.0, 600.0, 8000.0, 16000.0, 16600.0)
    on = float(rc.group_makespan_s(*args, window=5.0))
    off = float(rc.group_makespan_s(*args, window=5.0, reprefill=False))
    # Every resident request (here all 5 x 40 = 200 in flight fit: 200 < max_running, KV at the average
    # context) prefills its average context once per batch.
    avg_kv = 600.0 + 8000.0 / 2
    conc = min(200.0, 256.0, rc.kv_capacity_tokens() / avg_kv)
    ovh = c.hardware.prefill_overhead_s
    assert on - off == pytest.approx(conc * (float(rc.prefill_s(avg_kv)) - ovh) + ovh, rel=1e-9)
    # Synchronous mode has no requests in flight across a weight update: nothing added.
    assert float(rc.group_makespan_s(*args)) == float(rc.group_makespan_s(*args, reprefill=False))
    # The planner gives rollout at least as many GPUs when it knows about the re-prefill.
    h = [(600, 600 + (20000 if i % 20 == 0 else 6000)) for i in range(200)]
    base = PlannerConfig(global_batch=128, mode="async", staleness=4)
    with_rp = solve("a800x48", "qwen3-14b", h, base)
    without = solve("a800x48", "qwen3-14b", h, PlannerConfig(global_batch=128, mode="async", staleness=4,
                                                            reprefill_on_sync=False))
    assert with_rp.rollout_gpus >= without.rollout_gpus
    assert with_rp.t_rollout_s >= without.t_rollout_s * 0.999
