"""C-MLFQ's drift and growth switches (scheduler/drift.py) on trajectories built here with known answers."""

import math

import pytest

from areal_libra.cmlfq import RequestInfo, make_policy
from areal_libra.cmlfq.drift import GrowthTable, LengthDrift, growth_factor
from areal_libra.cmlfq.replay import decision_points, replay
from areal_libra.trace import Segment, ToolReturn, Trajectory

B = [1000, 2000, 8000]


def traj(tid, pid, step, prompt, gens, payload=100):
    """len(gens) - 1 tool calls of `payload` tokens, then a final answer."""
    segs = [Segment(g, ToolReturn("search", payload, "success")) for g in gens[:-1]] + [Segment(gens[-1], None)]
    return Trajectory(tid, pid, step, prompt, tuple(segs))


def drifting(steps, rate, prompts=("a", "b", "c", "d", "e", "f"), per=4):
    """Prompt i has base length 300 * (i + 1) (a mix of easy and hard prompts); every prompt appears at
    every other step and its generated length grows by exp(rate) per step."""
    out = []
    for k in steps:
        for i, p in enumerate(prompts):
            if (i + k) % 2:
                continue
            g = round(300 * (i + 1) * math.exp(rate * k))
            out += [traj(f"{p}{k}-{j}", p, k, 50, [g]) for j in range(per)]
    return out


def test_length_drift_recovers_a_geometric_rate_within_prompts():
    d = LengthDrift(max_steps=8)
    d.add_all(drifting(range(6), 0.05))
    d.refit()
    assert d.source == "within_prompt" and d.ref == 5
    assert d.rate == pytest.approx(0.05, abs=0.002)
    assert d.level(7) == pytest.approx(math.exp(0.1), rel=0.01)
    # No drift but an alternating mix of easy and hard prompts: the step means swing, the within-prompt
    # slope does not.
    flat = LengthDrift()
    flat.add_all(drifting(range(6), 0.0))
    flat.refit()
    assert abs(flat.rate) < 1e-9
    means = LengthDrift(min_prompts=1000)  # never enough recurring prompts: falls back to step means
    means.add_all(drifting(range(6), 0.0))
    means.refit()
    assert means.source == "step_means" and abs(means.rate) > 0.02


def test_length_drift_forgets_old_steps_and_caps_the_rate():
    d = LengthDrift(max_steps=2, max_rate=0.1)
    d.add_all(drifting(range(6), 0.5))
    d.refit()
    assert sorted({k for _, k in d._cells}) == [4, 5]
    assert d.rate == 0.1
    with pytest.raises(ValueError):
        LengthDrift(max_steps=1)


def test_drift_corrected_start_is_closer_than_uncorrected():
    # One prompt, lengths growing 15% a step; at step 6 its length lands in the second bucket while the
    # raw history (steps 0-5) says the first.
    hist = [traj(f"h{k}-{j}", "q", k, 50, [round(600 * 1.15 ** k)]) for k in range(6) for j in range(4)]
    now = traj("now", "q", 6, 50, [round(600 * 1.15 ** 6)])
    assert now.final_length > B[0] and max(t.final_length for t in hist) <= B[0] + 300
    plain = make_policy("cmlfq", B, center=0.5, min_samples=1)
    corr = make_policy("cmlfq", B, center=0.5, min_samples=1, drift=True)
    for p in (plain, corr):
        p.fit(hist)
    req = decision_points(now)[0]
    assert plain.start(req) == 0
    assert corr.start(req) == 1
    assert corr.drift.rate == pytest.approx(math.log(1.15), abs=0.01)


def test_drift_respects_the_visibility_rule():
    hist = drifting(range(4), 0.1)
    pol = make_policy("cmlfq", B, center=0.5, min_samples=1, drift=True)
    pol.fit(hist)
    rate, ref = pol.drift.rate, pol.drift.ref
    step4 = [t for t in drifting([4], 0.4)]  # the running step's outcomes jump: nothing may see them yet
    reqs = [decision_points(t)[0] for t in step4]
    before = [pol.start(r) for r in reqs]
    for t in step4:
        pol.finish(t)
    assert (pol.drift.rate, pol.drift.ref) == (rate, ref)
    assert [pol.start(r) for r in reqs] == before
    pol.end_step()  # the step is over: now its outcomes count
    assert pol.drift.ref == 4 and pol.drift.rate > rate
    # A request that does not carry its step is taken to run the step after the newest visible one.
    assert pol.drift.routed_step(0) == 5 and pol.drift.routed_step(9) == 9


def test_drift_off_and_rate_zero_change_nothing():
    hist = drifting(range(4), 0.0)
    evals = drifting([4, 5], 0.0)
    a = replay(_fit(make_policy("cmlfq", B, min_samples=1), hist), evals)
    b = replay(_fit(make_policy("cmlfq", B, min_samples=1, drift=True), hist), evals)
    assert a == b


def _fit(pol, trajs):
    pol.fit(trajs)
    return pol


def test_growth_table_and_factor():
    g = GrowthTable(max_prompts=2)
    g.add("p", 50, [50, 150, 350])
    g.add("p", 50, [50, 250])
    assert g.typical("p", 1) == 150 and g.typical("p", 2) == 300
    assert g.typical("zz", 1) == 150  # unknown prompt: the global table
    assert g.typical("p", 3) is None
    g.add("x", 50, [50, 60])
    g.add("y", 50, [50, 60])  # evicts the least recently updated prompt, p
    assert g.typical("p", 2) == 300  # ...whose depth-2 history still lives in the global table
    assert g.typical("p", 1) == pytest.approx((100 + 200 + 10 + 10) / 4)
    assert growth_factor(200, 100, 0.5) == pytest.approx(math.sqrt(2))
    assert growth_factor(1000, 1, 1.0) == 4.0 and growth_factor(5, None, 1.0) == 1.0


def test_growth_moves_a_fast_growing_sample_up():
    # The prompt's samples grow 200 tokens by their first tool return and end at 1,250 (bucket 1). A
    # sample that has already grown 800 is on course for far more; with growth on it moves to bucket 2.
    hist = [traj(f"h{j}", "q", 0, 50, [100, 1000]) for j in range(6)]
    fast = RequestInfo("f", "q", 50, 50 + 700 + 100, 700, (ToolReturn("search", 100, "success"),), 1, None,
                       (50, 850))
    plain = _fit(make_policy("cmlfq", B, center=0.5, min_samples=1), hist)
    grow = _fit(make_policy("cmlfq", B, center=0.5, min_samples=1, growth=1.0), hist)
    assert plain.tool_return(fast, 1) == 1
    assert grow.tool_return(fast, 1) == 2
    # A sample growing like its siblings is left alone by either.
    usual = RequestInfo("u", "q", 50, 250, 100, (ToolReturn("search", 100, "success"),), 1, None, (50, 250))
    assert plain.tool_return(usual, 1) == grow.tool_return(usual, 1) == 1
