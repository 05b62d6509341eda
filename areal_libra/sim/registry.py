"""The systems the simulator compares, by name: the baselines (sim/systems.py) and Libra with its
ablation rungs (sim/libra.py). Kept apart from both so that neither imports the other."""

from __future__ import annotations

from areal_libra.sim.cluster import Simulation
from areal_libra.sim.libra import ladder_base, libra_system, static_libra_loop
from areal_libra.sim.systems import (
    LADDER,
    SYSTEMS,
    Env,
    SystemSpec,
    areal_static_optimal,
    check_cluster,
    verl_colocated,
    verl_greedy,
    verl_static_uniform,
)


def build_system(name: str, env: Env) -> SystemSpec:
    check_cluster(env.truth, env.n_gpus)
    if name == "verl_colocated":
        return verl_colocated(env)
    if name == "verl_static_uniform":
        return verl_static_uniform(env)
    if name == "verl_greedy":
        return verl_greedy(env)
    if name == "areal_static_optimal":
        return areal_static_optimal(env)
    if name == "static_libra_loop":
        return static_libra_loop(env)
    if name == "static_uniform":
        return ladder_base(env)
    if name in ("libra", "+planner", "+hetero_tp", "+cmlfq", "+elastic"):
        return libra_system(name, env)
    raise ValueError(f"unknown system {name!r}; choose from {', '.join(SYSTEMS + LADDER)}")


def run_system(name: str, env: Env, steps: int, spec: SystemSpec | None = None) -> tuple[dict, Simulation]:
    """Run system `name` for `steps`; `spec`: the one build_system(name, env) made (a caller that reads its
    controller's starting state, e.g. Libra's first plan)."""
    spec = spec if spec is not None else build_system(name, env)
    sim = Simulation(env.truth, env.workload, env.n_gpus, spec.layout, spec.run, spec.router_factory(spec.layout),
                     spec.controller, seed=env.seed)
    attach = getattr(spec.controller, "attach", None)
    if attach is not None:
        attach(sim)
    set_run_length = getattr(spec.controller, "set_run_length", None)
    if set_run_length is not None:
        set_run_length(steps)
    res = sim.run(steps)
    res.update(spec.extra)
    return res, sim
