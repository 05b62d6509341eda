"""C-MLFQ's migration rule priced by the Cost Evaluator (cmlfq/migration.py) and its least-loaded fallback
(policy.DecisionAccuracy): the expected values are computed here from RolloutCost, not copied from a run."""

import math

import pytest

from areal_libra.cmlfq import MigrationPricer, RequestInfo, make_policy
from areal_libra.cmlfq.policy import FALLBACK_MIN_DECISIONS, DecisionAccuracy
from areal_libra.cost import RolloutCost, load_cluster, load_model
from areal_libra.trace import Segment, ToolReturn, Trajectory

HW = load_cluster("a800x48").hardware
MODEL = load_model("qwen3-14b")
B = [1000, 4000, 40000]
TPS = (1, 2, 8)


def pricer(tps=TPS) -> MigrationPricer:
    return MigrationPricer(HW, MODEL, tps)


def traj(tid, pid, step, prompt, segs):
    return Trajectory(tid, pid, step, prompt,
                      tuple(Segment(g, None if p is None else ToolReturn("search", p)) for g, p in segs))


def test_price_is_remaining_decode_saving_against_reprefill_from_the_cost_evaluator():
    p = pricer()
    ctx, payload, rem = 3000, 500, 6000
    pr = p.price(ctx, payload, rem, 0, 2)
    c1, c8 = RolloutCost(HW, MODEL, 1), RolloutCost(HW, MODEL, 8)
    kv = ctx + rem / 2

    per_gpu = min(256.0, c1.kv_capacity_tokens() / kv)  # a TP1 server's batch of requests like this one

    def batch(c):  # a balanced fleet: every GPU holds per_gpu of them
        conc = min(256.0, c.kv_capacity_tokens() / kv)
        return min(c.tp * per_gpu, conc), c.tp * per_gpu

    def tok(c):
        b, n = batch(c)
        return float(c.decode_step_s(b, b * kv)) * n / b

    assert pr.saving_s == pytest.approx(rem * (tok(c1) - tok(c8)))
    # A prefill stalls the server's whole running batch.
    assert pr.cost_s == pytest.approx(max(0.0, float(c8.prefill_s(ctx)) * batch(c8)[0]
                                          - float(c1.prefill_s(payload, ctx - payload)) * batch(c1)[0]))
    assert pr.cost_s > 0
    assert pr.worth == (pr.saving_s > pr.cost_s)
    # A measured load: an idle target decodes at batch 1, a crowded current server waits its turn.
    loaded = p.price(ctx, payload, rem, 0, 2, loads=[400.0, 0.0, 0.0])
    assert loaded.saving_s > pr.saving_s
    # A final context beyond the current bucket's KV pool cannot stay there.
    cap1 = c1.kv_capacity_tokens()
    assert math.isinf(p.price(cap1 - 10, 10, 100, 0, 2).saving_s) and p.price(cap1 - 10, 10, 100, 0, 2).worth
    with pytest.raises(ValueError):
        MigrationPricer(HW, MODEL, [])


def test_a_move_whose_reprefill_costs_more_than_its_saving_is_not_made():
    # History: after the first tool return the prompt always decodes 5,000 more tokens (bucket 2 by mean and
    # P90). A request with 30,000 tokens of context there: moving re-prefills 30,000 tokens to save decode
    # time on only 5,000. Between servers of the same TP (no load known) the saving is zero.
    hist = [traj(f"h{i}", "p", 0, 100, [(100, 29_800), (5000, None)]) for i in range(5)]
    req = RequestInfo("x", "p", 100, 30_000, 100, (ToolReturn("search", 29_800),), 1, None, (100, 30_000))
    free = make_policy("cmlfq", B, center=None, start_lookup=False)
    free.fit(hist)
    assert free.tool_return(req, 1) == 2  # unpriced, the tree's rule moves it
    same = make_policy("cmlfq", B, center=None, start_lookup=False, pricer=pricer((8, 8, 8)))
    same.fit(hist)
    assert same.tool_return(req, 1) == 1 and same.priced_out == 1
    pr = pricer().price(30_000, 29_800, 5000.0, 1, 2)
    priced = make_policy("cmlfq", B, center=None, start_lookup=False, pricer=pricer())
    priced.fit(hist)
    assert priced.tool_return(req, 1) == (2 if pr.worth else 1)
    # The same move with a short context and a long remaining length pays: it is made.
    hist2 = [traj(f"g{i}", "q", 0, 100, [(100, 800), (30_000, None)]) for i in range(5)]
    req2 = RequestInfo("y", "q", 100, 1000, 100, (ToolReturn("search", 800),), 1, None, (100, 1000))
    idle = [0.0, 0.0, 0.0]  # an idle target: its prefill stalls no one else
    assert pricer().price(1000, 800, 30_000.0, 0, 2, loads=idle).worth
    pol = make_policy("cmlfq", B, center=None, start_lookup=False, pricer=pricer(), load_fn=lambda: idle)
    pol.fit(hist2)
    assert pol.tool_return(req2, 0) == 2 and pol.priced_out == 0


def test_decision_accuracy_against_the_fallbacks_chance():
    acc = DecisionAccuracy(3, 1000)
    assert not acc.low()  # nothing measured yet: no verdict
    for i in range(300):  # chosen independently of the true bucket: chance level
        acc.add(i % 3, (i // 3) % 3)
    n, a, base = acc.stats()
    assert n == 300 and a == pytest.approx(base) and acc.low()
    good = DecisionAccuracy(3, 1000)
    for i in range(300):
        good.add(i % 3, i % 3)
    assert not good.low() and not good.low([8, 4, 16])
    # Buckets of one server kind are one class: a bucket-0 / bucket-2 mix-up on TP8 servers is no error.
    kinds = DecisionAccuracy(3, 1000, kinds=(8, 4, 8))
    kinds.add(0, 2)
    assert kinds.stats()[1] == 1.0
    few = DecisionAccuracy(3, 1000)
    for _ in range(FALLBACK_MIN_DECISIONS - 1):
        few.add(0, 1)
    assert not few.low()


def test_fallback_routes_least_loaded_while_accuracy_is_low_and_keeps_scoring_in_the_shadow():
    # The tree learns that prompt "p" ends long (bucket 2); the trajectories that follow all end short.
    hist = [traj(f"h{i}", "p", 0, 100, [(30_000, None)]) for i in range(5)]
    loads = [0.0, 5.0, 3.0]

    def run(**kw):
        pol = make_policy("cmlfq", B, center=None, load_fn=lambda: loads, **kw)
        pol.fit(hist)
        for i in range(FALLBACK_MIN_DECISIONS):
            t = traj(f"s{i}", "p", 1, 100, [(50, None)])
            assert pol.start(RequestInfo(t.trajectory_id, "p", 100, 100, 0, (), 1, None, (100,))) == 2
            pol.finish(t)
        assert pol.fallback_fraction() == 0.0
        pol.end_step()
        return pol

    pol, off = run(fallback=True), run()  # off: fallback off, C-MLFQ always decides
    assert pol.fallback_active and not off.fallback_active  # every decision was wrong
    req = RequestInfo("n", "p", 100, 100, 0, (), 2, None, (100,))
    own = off.start(req)
    assert own != 0
    assert pol.start(req) == 0  # least-loaded
    assert pol._made["n"] == [own]  # C-MLFQ's own decision, scored when the trajectory finishes
    tr = RequestInfo("n", "p", 100, 200, 50, (ToolReturn("search", 50),), 2, None, (100, 200))
    assert pol.tool_return(tr, 0) == 0  # no move in fallback
    assert len(pol._made["n"]) == 2
    assert pol.fallback_fraction() == pytest.approx(2 / (FALLBACK_MIN_DECISIONS + 2))
    pol.finish(traj("n", "p", 2, 100, [(50, 50), (50, None)]))
    assert len(pol.accuracy.scored) == FALLBACK_MIN_DECISIONS + 2


def test_placement_by_a_prompts_own_history_but_least_loaded_from_the_global_root():
    # Prompt "p" has its own history (ends long: bucket 2 on TP8); prompt "new" has none, so its prediction
    # comes from the global root, the same for every such request: it goes to the least-loaded bucket.
    hist = [traj(f"h{i}", "p", 0, 100, [(30_000, None)]) for i in range(5)]
    loads = [3.0, 0.5, 2.0]  # per GPU: bucket 1 (TP2) is the least loaded
    pol = make_policy("cmlfq", B, center=None, pricer=pricer(), load_fn=lambda: loads)
    pol.fit(hist)
    own = RequestInfo("a", "p", 100, 100, 0, (), 1, None, (100,))
    new = RequestInfo("b", "new", 100, 100, 0, (), 1, None, (100,))
    assert pol.start(own) == 2  # 30,000 tokens to decode: TP8 is faster even with its load
    assert pol.start(new) == 1
    bare = make_policy("cmlfq", B, center=None)  # no price, no load: the tree's bucket for both
    bare.fit(hist)
    assert bare.start(new) == 2
