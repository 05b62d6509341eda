"""Libra's working-set admission (cmlfq.aging.admit_group, RunConfig.working_set_admission): no new group starts
while the running trajectories' contexts fill the rollout KV, so an overloaded pool queues instead of thrashing."""

from dataclasses import replace

from areal_libra.cmlfq.aging import admit_group
from areal_libra.sim import cluster
from areal_libra.sim.registry import build_system
from areal_libra.sim.report import make_env


def test_admit_group_is_the_kv_capacity():
    assert admit_group(0, 100) and admit_group(99, 100)
    assert not admit_group(100, 100) and not admit_group(150, 100)
    assert not admit_group(0, 0)  # no rollout server: nothing fits


def _run(gate: bool):
    # R2E-Gym at 32 x 16 on 16 A800s: (eta + 1) batches of 16-turn software-engineering trajectories are far
    # more context than the rollout servers hold.
    env = make_env("r2e_gym", "a800x16", "qwen3-14b", seed=0, batch_prompts=32, group_size=16)
    spec = build_system("+cmlfq", env)
    run = replace(spec.run, working_set_admission=gate)
    sim = cluster.Simulation(env.truth, env.workload, env.n_gpus, spec.layout, run, spec.router_factory(spec.layout),
                             None, seed=env.seed)
    res = sim.run(6)
    return res, sim


def test_an_overloaded_pool_queues_new_groups_instead_of_thrashing(monkeypatch):
    calls = []
    monkeypatch.setattr(cluster, "admit_group", lambda w, c: calls.append((w, c)) or admit_group(w, c))
    gated, sim_g = _run(True)
    assert any(w >= c for w, c in calls) and all(c == sum(s.capacity for s in sim_g.servers) for _, c in calls)
    free, sim_f = _run(False)
    assert gated["steps"] == free["steps"] == 6
    # What the gate saves is re-prefill: contexts evicted while their trajectories wait on a tool.
    prefill = [sum(s.prefill_tokens for s in sim.servers) for sim in (sim_g, sim_f)]
    assert prefill[0] < 0.85 * prefill[1]
    assert gated["tokens_per_s"] > free["tokens_per_s"]


def test_libra_admits_by_working_set_and_areals_loop_does_not():
    env = make_env("r2e_gym", "a800x16", "qwen3-14b", seed=0)
    assert build_system("libra", env).run.working_set_admission
    assert not build_system("areal_static_optimal", env).run.working_set_admission
