"""Simulation.apply_layout keeps a server for any bucket of its TP, as the live fleet keeps every server whose
kind the new layout still needs (areal_libra/rollout/fleet.py); SimCluster.reconfig_cost_s prices it so."""

from areal_libra.sim.cluster import Layout, RunConfig, Simulation
from areal_libra.sim.report import make_env
from areal_libra.sim.systems import policy_router, split_layout


def _running(sim):
    return [(s.sid, req) for s in sim.servers for req in s.active]


def test_a_bucket_change_keeps_the_servers_and_what_they_hold():
    env = make_env("r2e_gym", "a800x48", "qwen3-14b", seed=1, batch_prompts=16, group_size=16)
    lay = split_layout(env, 16, 4)  # 4 x TP4, one bucket
    sim = Simulation(env.truth, env.workload, env.n_gpus, lay, RunConfig(max_staleness=2),
                     policy_router("least_loaded")(lay), seed=1)
    sim.run(2)
    running = _running(sim)
    assert running
    before = {s.sid for s in sim.servers}
    # three of the four TP4 servers in two routing buckets, the fourth's GPUs as two TP2 servers
    new = Layout(lay.train, [(4, 0), (4, 0), (4, 1), (2, 1), (2, 1)], [8192, lay.bucket_limits[-1]])
    sim.apply_layout(new, train_changed=False)
    kept = {s.sid: s for s in sim.servers if s.tp == 4}
    assert len(kept) == 3 and set(kept) <= before  # no TP4 server restarted
    assert sorted(s.bucket for s in kept.values()) == [0, 0, 1]
    stayed = [(sid, req) for sid, req in running if sid in kept]
    assert stayed
    for sid, req in stayed:  # not re-prefilled elsewhere: still running where they were, in its new bucket
        assert req in kept[sid].active and req.bucket == kept[sid].bucket
    sim.run(4)  # and the run goes on


def test_the_cost_of_a_bucket_change_is_only_the_new_servers_start():
    from areal_libra.control.prediction import layout_plan
    from areal_libra.cost.training import TrainParallel
    from areal_libra.planner.types import Plan, RolloutInstance
    from areal_libra.sim.libra import LibraOptions, SimCluster, libra_run_config

    env = make_env("search_r1", "a800x48", "qwen3-14b", seed=0, batch_prompts=16, group_size=4)
    lay = split_layout(env, 16, 4)
    sim = Simulation(env.truth, env.workload, env.n_gpus, lay, libra_run_config(env),
                     policy_router("least_loaded")(lay), seed=0)
    cl = SimCluster(env, LibraOptions(elastic=False, cmlfq=False), [])
    cl.attach(sim)
    t = lay.train
    par = TrainParallel(t.tp, t.pp, t.dp)
    cap = env.workload.cfg.max_len
    a = layout_plan(16, 4, par, cap, env.n_gpus)  # 4 x TP4, one bucket
    # 2 x TP2 for the short requests, 3 of the TP4 servers for the rest (now the second bucket)
    b = Plan(train=par, rollout_gpus=16, instances=[RolloutInstance(tp=2, count=2, max_len=4096),
                                                    RolloutInstance(tp=4, count=3, max_len=cap)],
             t_train_s=0, t_rollout_s=0, makespan_s=0, solve_s=0, n_gpus=env.n_gpus)
    assert not cl.same_layout(a, b)
    # the TP2 servers start while one TP4 server's 4 GPUs of 16 stop serving; the kept TP4 servers serve on
    assert cl.reconfig_cost_s(a, b) == env.truth.server_start_s(2) * 4 / 16
