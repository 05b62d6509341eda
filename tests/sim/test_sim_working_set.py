"""Libra's working-set admission (cmlfq.aging.admit_group, RunConfig.working_set_admission): no new group starts
while the running trajectories' contexts fill the rollout KV, so an overloaded pool queues instead of thrashing."""

from dataclasses import replace

from areal_libra.cmlfq.aging import admit_group
from areal_libra.sim import cluster
from areal_libra.sim.registry import build_system, run_system
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


def test_the_admission_counts_only_the_servers_that_stay(monkeypatch):
    # R2E-Gym on 48 A800s: Libra's pool is lent to rollout through the fill and joins training at step 0; the
    # gate must not admit against the KV the pool takes back.
    caps = []  # (all servers' KV, the staying servers' KV, what the gate was given)
    orig = cluster.Simulation._admit_groups

    def admit_groups(self, cap, limit):
        caps.append([sum(s.capacity for s in self.servers), sum(s.capacity for s in self.servers if not s.lent)])
        return orig(self, cap, limit)

    monkeypatch.setattr(cluster.Simulation, "_admit_groups", admit_groups)
    monkeypatch.setattr(cluster, "admit_group", lambda w, c: caps[-1].append(c) or admit_group(w, c))
    env = make_env("r2e_gym", "a800x48", "qwen3-14b", seed=0)
    run_system("+elastic", env, 2)
    gated = [c for c in caps if len(c) > 2]
    assert gated and all(c[2:] == [c[1]] * (len(c) - 2) for c in gated)
    assert any(total > staying for total, staying, *_ in gated)  # the lent hybrids were serving then
