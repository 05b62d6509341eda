"""Elastic Hybrid Pool workers taken from the plan's training replicas: the core keeps more than half."""

import pytest

from areal_libra.sim.cluster import Layout, TrainLayout
from areal_libra.sim.libra import hybrid_from_train


@pytest.mark.parametrize("dp,expect", [(1, 0), (2, 0), (3, 1), (4, 1), (5, 2), (8, 3)])
def test_elastic_workers_never_take_half_the_trainer(dp, expect):
    lay = Layout(TrainLayout(2, 2, dp), [(1, 0)] * 10 + [(2, 1)] * 4, [4000, 30000])
    core, units = hybrid_from_train(lay, max_units=3)
    assert core is lay
    assert len(units) == expect
    for u in units:
        assert u.training  # they start as training replicas
        assert sum(tp for tp, _ in u.specs) == 4  # one replica's GPUs (tp*pp) as rollout servers
        assert {b for _, b in u.specs} == {0}  # the bucket holding the most rollout GPUs


def test_elastic_moves_are_counted_in_the_summary():
    """Every join/release the elastic pool carries out counts once in `elastic_moves` (a request for a move
    that finds no unit to move does not), next to `reconfigurations` (re-plans)."""
    from areal_libra.sim.cluster import RunConfig, Simulation
    from areal_libra.sim.libra import LibraOptions, SimCluster
    from areal_libra.sim.report import make_env
    from areal_libra.sim.systems import policy_router

    env = make_env("search_r1", "a800x16", "qwen3-14b", 0, 2)
    lay = Layout(TrainLayout(1, 1, 8), [(1, 0)] * 8, [env.workload.cfg.max_len])
    core, units = hybrid_from_train(lay, max_units=2)
    assert len(units) == 2
    sim = Simulation(env.truth, env.workload, env.n_gpus, core, RunConfig(max_staleness=4),
                     policy_router("least_loaded")(core), seed=0)
    cl = SimCluster(env, LibraOptions(), units)
    cl.attach(sim)
    assert cl.release(2, 0) == 2 and sim.elastic_moves == 1  # one move of two replicas
    assert cl.release(1, 0) == 0 and sim.elastic_moves == 1  # nothing left to release
    assert cl.join(1, 0) == 1 and sim.elastic_moves == 2
    res = sim.run(2)
    assert res["elastic_moves"] == 2
    assert res["reconfigurations"] == 0


def test_the_pool_serves_rollout_through_the_fill_and_trains_from_the_first_step():
    """The first plan's hybrids serve rollout until the first batch (AReaL's trainer has nothing to train before
    it), then all join: step 0 trains on the plan's whole DP, and their servers did rollout work before."""
    from areal_libra.sim.libra import lend_in_fill, make_hybrid
    from areal_libra.sim.registry import build_system, run_system
    from areal_libra.sim.report import make_env

    env = make_env("search_r1", "a800x16", "qwen3-14b", 0, 4)
    spec = build_system("libra", env)
    units = spec.controller.cluster.units
    assert units and not any(u.training for u in units)  # lent to rollout at t=0
    lay = spec.layout
    plan_dp = lay.train.dp + len(units)
    # the same pool, not lent: the plan's layout with every unit training
    t = lay.train
    _, fresh = make_hybrid(Layout(TrainLayout(t.tp, t.pp, plan_dp, t.micro_batch), lay.servers, lay.bucket_limits),
                           len(units))
    assert len(fresh) == len(units) and lend_in_fill(lay, []) == lay
    res, sim = run_system("libra", env, 2, spec)
    unit_gpus = lay.train.tp * lay.train.pp
    assert sim.records[0]["train_gpus"] == plan_dp * unit_gpus
    assert all(u.training and not u.servers for u in units)
    assert sim._retired_busy > 0  # the lent servers decoded before they handed their GPUs back
    assert res["elastic_moves"] == 0  # the pool's start, not a controller decision


def test_a_replan_sends_the_displaced_requests_through_the_new_layouts_router():
    """A re-plan from one bucket to three retires every server; their requests are sent again through the new
    layout's router (its bucket of their context, spilled when that bucket is overloaded), as the live client
    resends an aborted request, instead of all landing on the new first bucket's one TP1 server."""
    from areal_libra.sim.cluster import Simulation
    from areal_libra.sim.libra import LibraOptions, SimCluster, _router_for
    from areal_libra.sim.registry import build_system
    from areal_libra.sim.report import make_env

    env = make_env("dapo_math", "a800x16", "qwen3-14b", 0, 8)
    spec = build_system("+cmlfq", env)
    old = Layout(TrainLayout(2, 1, 4), [(4, 0), (4, 0)], [env.workload.cfg.max_len])
    sim = Simulation(env.truth, env.workload, env.n_gpus, old, spec.run, _router_for(old, LibraOptions(), None, env=env),
                     seed=0)
    sim.run(1)
    carried = sum(s.load() for s in sim.servers)
    assert carried > 20
    m = env.workload.cfg.max_len
    new = Layout(TrainLayout(2, 1, 4), [(1, 0), (2, 1), (4, 2)], [m // 8, m // 4, m])
    cl = SimCluster(env, LibraOptions(elastic=False), [])
    cl.attach(sim)
    cl.apply_layout(new)  # what a re-plan to this layout does
    loads = {s.bucket: s.load() for s in sim.servers}
    assert sum(loads.values()) >= carried
    assert loads[0] < 0.8 * sum(loads.values())  # spread over the buckets, not piled on the TP1 server
