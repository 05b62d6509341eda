"""EmulatedWorkflow across AReaL's per-step construction: one generator, RNG and group queue per setting, so a
new instance (AReaL resolves the workflow at every prepare_batch) continues the draws instead of repeating them."""

from __future__ import annotations

from areal.api.cli_args import GenerationHyperparameters

from areal_libra.rollout import emulated_workflow as ew


def _lengths(wf: ew.EmulatedWorkflow, prompts: range) -> list[int]:
    return [wf._next(p, 0).final_length for p in prompts for _ in range(4)]


def test_a_new_instance_continues_the_draws() -> None:
    g = GenerationHyperparameters(n_samples=4)
    ew._SHARED.clear()
    first = _lengths(ew.EmulatedWorkflow(g, workload="dapo_math", seed=7), range(0, 6))
    second = _lengths(ew.EmulatedWorkflow(g, workload="dapo_math", seed=7), range(6, 12))
    ew._SHARED.clear()
    one = ew.EmulatedWorkflow(g, workload="dapo_math", seed=7)
    assert _lengths(one, range(0, 6)) + _lengths(one, range(6, 12)) == first + second
    assert second != first  # the second step's groups are new draws, not the first step's again
    ew._SHARED.clear()
    other = _lengths(ew.EmulatedWorkflow(g, workload="dapo_math", seed=8), range(0, 6))
    assert other != first


def test_the_profiling_pass_plays_the_simulators_profile_groups() -> None:
    # The live profiling pass (live.train.profile_pass) gives prompt i the workload's profile group i: the draws
    # the simulator's first plan is solved on (control.profile), whatever order the prompts finish in, and apart
    # from the training draws.
    from areal_libra.sim.workloads import make_workload

    g = GenerationHyperparameters(n_samples=4)
    ew._SHARED.clear()
    train_before = _lengths(ew.EmulatedWorkflow(g, workload="search_r1", seed=0), range(0, 3))
    ew._SHARED.clear()
    wf = ew.EmulatedWorkflow(g, workload="search_r1", seed=0, **ew.EmulatedWorkflow.profile_kwargs(5))
    played = {p: [wf._next(p, 0).final_length for _ in range(4)] for p in (3, 0, 4, 1, 2)}
    wl = make_workload("search_r1")
    wl.cfg.group_size = 4
    prof = [t.final_length for t in wl.profile(5)]
    assert [x for p in range(5) for x in played[p]] == prof
    assert _lengths(ew.EmulatedWorkflow(g, workload="search_r1", seed=0), range(0, 3)) == train_before
