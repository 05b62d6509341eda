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
