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


def _run_pair(monkeypatch, defer: bool):
    """A paper-like batch (16 groups of 16 at once on few servers) for 3 steps, then a layout change that
    retires servers mid-step, then 2 more steps; returns what the run reports and how many chunks it
    materialized (drew noise for and queued)."""
    from areal_libra.sim.cluster import Layout, RunConfig, Simulation
    from areal_libra.sim.report import make_env
    from areal_libra.sim.systems import policy_router, split_layout

    count = [0]
    real = RolloutServer.materialize

    def counting(self):
        count[0] += 1
        return real(self)

    monkeypatch.setattr(RolloutServer, "materialize", counting)
    env = make_env("r2e_gym", "a800x48", "qwen3-14b", seed=1, batch_prompts=16, group_size=16)
    lay = split_layout(env, 16, 4)
    sim = Simulation(env.truth, env.workload, env.n_gpus, lay, RunConfig(max_staleness=2),
                     policy_router("least_loaded")(lay), seed=1)
    sim.defer_arrivals = defer
    sim.run(3)
    sim.apply_layout(Layout(lay.train, [(2, 0)] * 8, lay.bucket_limits), train_changed=False)
    out = sim.run(5)
    states = [s.rng.getstate() for s in sim.servers]
    return (out, sim.records, sim.t, states, sim.migrated_tokens), count[0]


def test_deferred_chunks_change_nothing(monkeypatch):
    eager, n_eager = _run_pair(monkeypatch, defer=False)
    deferred, n_deferred = _run_pair(monkeypatch, defer=True)
    assert deferred == eager  # same records, clock, migrations and every server's generator state
    assert n_deferred < 0.9 * n_eager  # and the deferral did skip chunks


def test_gc_paused_restores_the_collector():
    import gc

    from areal_libra.sim.cluster import gc_paused

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # left as it was
    finally:
        gc.enable()


def test_trace_workload_copy_shares_only_the_trace():
    import copy

    from areal_libra.sim.workloads import make_workload

    wl = make_workload("search_r1")
    wl.sample_group(0, random.Random(0))
    twin = copy.deepcopy(wl)
    assert twin.groups is wl.groups and twin.cfg is not wl.cfg and twin.cfg == wl.cfg
    a, b = wl.sample_group(3, random.Random(5)), twin.sample_group(3, random.Random(5))
    assert a == b  # same trajectories, ids included (the copy's counter continues from the original's)
    twin.cfg.length_scale = 2.0
    n = wl._n
    twin.sample_group(0, random.Random(9))
    assert wl.cfg.length_scale != 2.0 and wl._n == n  # the copy's config and counter are its own


def test_fast_segment_constructors_build_the_plain_objects():
    from areal_libra.sim.workloads import _segment, _tool

    assert _segment is not Segment and _tool is not ToolReturn  # the fast path is in use
    plain = Segment(7, ToolReturn("bash", 12, "failure", 1.25))
    fast = _segment(7, _tool("bash", 12, "failure", 1.25))
    assert fast == plain and hash(fast) == hash(plain) and repr(fast) == repr(plain)
    assert vars(fast) == vars(plain) and list(vars(fast.tool)) == list(vars(plain.tool))
    assert type(fast) is Segment and type(fast.tool) is ToolReturn
