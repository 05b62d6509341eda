"""The simulator's fast paths compute exactly what the plain code computes (same draws, same floats)."""

import math
import random
from bisect import bisect_right

from areal_libra.sim.hardware import truth_for
from areal_libra.sim.server import RolloutServer, SimRequest
from areal_libra.sim.workloads import R2EGym, lognormal
from areal_libra.trace import Segment, ToolReturn, Trajectory


def test_lognormal_draws_as_the_standard_library():
    a, b = random.Random(7), random.Random(7)
    for i in range(5000):
        mu, sigma = math.log(50 + i % 300), 0.2 + (i % 7) / 10
        assert lognormal(a.random, mu, sigma) == b.lognormvariate(mu, sigma)
    assert a.random() == b.random()  # both generators consumed the same draws


def test_tool_choice_draws_as_choices():
    names, cum = R2EGym._NAMES, R2EGym._CUM
    a, b = random.Random(3), random.Random(3)
    got = [names[bisect_right(cum, a.random() * (cum[-1] + 0.0), 0, len(cum) - 1)]
           for _ in range(3000)]
    want = [b.choices(names, cum_weights=cum)[0] for _ in range(3000)]
    assert got == want and set(got) == set(names)


def _plain_prefill(truth, tp, new, prior=0.0):
    m, c = truth.model, truth.c
    flops = 2.0 * m.active_params * new + 4.0 * m.layers * m.attn_dim * new * (prior + new / 2.0)
    comp = flops / (truth.gpu.flops * c.prefill_flop_eff * tp)
    return comp + 2 * m.layers * truth._allreduce_s(tp, new * m.hidden * 2.0)


def test_prefill_constants_give_the_same_floats():
    rng = random.Random(1)
    for gpu, model in (("a800", "qwen3-14b"), ("h100", "qwen3-8b")):
        truth = truth_for(gpu, model)
        for tp in (1, 2, 4, 8, 16):
            for _ in range(300):
                new, prior = rng.randint(1, 40000), rng.choice((0, rng.randint(1, 60000)))
                assert truth.prefill_s(tp, new, prior) == _plain_prefill(truth, tp, new, prior)
        assert truth.prefill_s(4, 0, 100) == 0.0


def test_preemption_retracts_the_latest_admitted_request():
    truth = truth_for("a800", "qwen3-14b")
    s = RolloutServer(0, 1, 0, truth, random.Random(0), mem_fraction=0.52)
    reqs = [SimRequest(Trajectory(f"t{i}", "p", 0, 4000, (Segment(3000, None),)), None, 0, 0.0) for i in range(40)]
    for r in reqs:
        s.enqueue(r, 0, 4000)
    s.start_chunk(0.0)
    while not s.preemptions:
        s.finish_chunk()
        s.start_chunk(s.clock)
    # the requests still running are exactly the earliest admitted ones
    admitted = sorted(s.active, key=lambda r: r.admit_order)
    assert list(s.active) == admitted
    victim = s.queue[0][0]
    assert victim.admit_order > max(r.admit_order for r in s.active)


def test_gen_before_follows_the_segments():
    segs = tuple(Segment(10 * (k + 1), ToolReturn("bash", 5, "success", 0.1) if k < 3 else None) for k in range(4))
    req = SimRequest(Trajectory("t", "p", 0, 100, segs), None, 0, 0.0)
    for k in range(4):
        req.seg = k
        assert req.gen_before() == sum(s.gen_tokens for s in segs[:k])
    req.seg = 1  # a reset (not done by the simulator) still gives the prefix sum
    assert req.gen_before() == 10
