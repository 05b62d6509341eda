"""The simulated Libra's in-flight slot statistics (sim.libra.group_slot_fields): measured from finished
GRPO groups only, E over groups of the longest member's generated tokens and tool waits."""

import areal_libra.sim.libra as L
from areal_libra.sim.report import make_env


def test_slot_fields_are_group_expectations(monkeypatch):
    env = make_env("r2e_gym", "a800x48", "qwen3-14b", seed=0)
    prof = env.workload.profile(6)
    g = env.workload.cfg.group_size
    monkeypatch.setattr(L, "SLOT_PRICING", False)
    assert L.group_slot_fields(env, prof, g) == {}
    monkeypatch.setattr(L, "SLOT_PRICING", True)
    monkeypatch.setattr(L, "HISTORY_TRIPLES", True)
    groups = [prof[i:i + g] for i in range(0, len(prof), g)]
    want_out = sum(max(t.model_tokens for t in grp) for grp in groups) / len(groups)
    want_wait = sum(max(sum(s.tool.latency_s for s in t.segments if s.tool) for t in grp) for grp in groups)
    fields = L.group_slot_fields(env, prof, g)
    assert fields["slot_output"] == want_out
    assert abs(fields["slot_wait_s"] - want_wait / len(groups) * env.truth.c.tool_latency_scale) < 1e-9
    assert fields["slot_wait_s"] > 0  # R2E-Gym's tool calls
    # An incomplete group (a member still running) is not counted.
    assert L.group_slot_fields(env, prof[: g - 1], g) == {}
