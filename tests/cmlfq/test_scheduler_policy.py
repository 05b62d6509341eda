"""Routing policies and the replay metrics, on hand-made trajectories whose answers are worked out here."""

import pytest

from areal_libra.cmlfq import POLICIES, RequestInfo, make_policy
from areal_libra.cmlfq.replay import decision_points, replay
from areal_libra.trace import Segment, ToolReturn, Trajectory

B = [100, 200, 400]


def traj(tid, pid, step, prompt, segs):
    """segs: list of (gen, payload, status) with payload None for the last segment."""
    out = []
    for gen, payload, *status in segs:
        out.append(Segment(gen, None if payload is None else ToolReturn("search", payload, *(status or ["success"]))))
    return Trajectory(tid, pid, step, prompt, tuple(out))


def test_make_policy_names_and_errors():
    assert set(POLICIES) == {"cmlfq", "round_robin", "least_loaded", "mlfq", "predictor", "oracle"}
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fifo", B)
    with pytest.raises(ValueError, match="ascending"):
        make_policy("mlfq", [200, 100])
    with pytest.raises(ValueError, match="unknown cmlfq switch"):
        make_policy("cmlfq", B, colour="red")
    p = make_policy("mlfq", B)
    assert [p.bucket_of(x) for x in (0, 100, 101, 400, 10_000)] == [0, 0, 1, 2, 2]


def test_replay_metrics_by_hand_for_mlfq():
    # prompt 50; seg0 gen 30 + payload 40 -> ctx 120 (> 100: MLFQ demotes to bucket 1 at the tool return);
    # seg1 gen 60 + payload 0 -> ctx 180 (stays); seg2 gen 50 -> final 230 (oracle bucket 2).
    t = traj("a", "p", 0, 50, [(30, 40), (60, 0), (50, None)])
    m = replay(make_policy("mlfq", B), [t])
    # decisions: start 0, after tool 1 -> 1, after tool 2 -> 1; oracle 2: none right.
    assert m.decision_accuracy == 0 and m.token_accuracy == 0
    assert m.migrations_per_trajectory == 1 and m.migrated_token_ratio == pytest.approx(120 / 230)
    o = replay(make_policy("oracle", B), [t])
    assert (o.decision_accuracy, o.token_accuracy, o.migrated_token_ratio) == (1.0, 1.0, 0.0)


def test_cmlfq_migrates_when_mean_and_p90_agree():
    # History (prompt "p", earlier step): after a failed first call the trajectory always grows by 300 more;
    # after a success by 10. Same prompt -> per-prompt node used.
    hist = [traj(f"h{i}", "p", 0, 50, [(10, 20, "failure"), (300, None)]) for i in range(5)]
    hist += [traj(f"g{i}", "p", 0, 50, [(10, 20, "success"), (10, None)]) for i in range(5)]
    pol = make_policy("cmlfq", B, center=None, start_lookup=False)
    pol.fit(hist)
    fail = RequestInfo("x", "p", 50, 80, 10, (ToolReturn("search", 20, "failure"),), 1, None, (50, 80))
    ok = RequestInfo("y", "p", 50, 80, 10, (ToolReturn("search", 20, "success"),), 1, None, (50, 80))
    assert pol.start(fail) == 0
    assert pol.tool_return(fail, 0) == 2  # 80 + 300 = 380 -> bucket 2 by mean and by P90
    assert pol.tool_return(ok, 0) == 0  # 80 + 10 -> stays
    assert pol.tool_return(ok, 2) == 0  # ... and a misplaced one comes back


def test_cmlfq_stays_when_mean_and_p90_disagree():
    hist = [traj(f"h{i}", "p", 0, 50, [(10, 20), (rem, None)]) for i, rem in enumerate([10] * 8 + [300] * 2)]
    pol = make_policy("cmlfq", B, center=None, start_lookup=False, min_samples=2)
    pol.fit(hist)
    req = RequestInfo("x", "p", 50, 80, 10, (ToolReturn("search", 20),), 1, None, (50, 80))
    # mean remaining 68 -> 148 (bucket 1); P90 300 -> 380 (bucket 2): no agreement, no move.
    assert pol.tool_return(req, 0) == 0
    agree = make_policy("cmlfq", B, center=None, min_samples=2)
    agree.fit([traj(f"h{i}", "p", 0, 50, [(10, 20), (90, None)]) for i in range(5)])
    assert agree.tool_return(req, 0) == 1  # 80 + 90 = 170 by both


def test_cmlfq_start_lookup_places_by_prompt_history():
    hist = [traj(f"h{i}", "long", 0, 50, [(300, None)]) for i in range(5)]
    pol = make_policy("cmlfq", B, center=None)
    pol.fit(hist)
    assert pol.start(RequestInfo("x", "long", 50, 50, 0, (), 1, None, (50,))) == 2  # 50 + 300 = 350
    paper = make_policy("cmlfq", B, center=None, start_lookup=False)
    paper.fit(hist)
    assert paper.start(RequestInfo("x", "long", 50, 50, 0, (), 1, None, (50,))) == 0


def test_visibility_rule_same_step_outcomes_are_invisible():
    # Step 1 holds two samples of prompt q; the second must be routed as if the first had not finished.
    train = [traj(f"h{i}", "q", 0, 50, [(10, 20), (10, None)]) for i in range(5)]
    a = traj("a", "q", 1, 50, [(10, 20), (400, None)])
    b = traj("b", "q", 1, 50, [(10, 20), (400, None)])
    alone = make_policy("cmlfq", B, min_samples=1)
    alone.fit(train)
    both = make_policy("cmlfq", B, min_samples=1)
    both.fit(train)
    m1 = replay(alone, [b])
    m2 = replay(both, [a, b])
    assert m1.decision_accuracy == m2.decision_accuracy
    # ...while a later step does see them.
    c = traj("c", "q", 2, 50, [(10, 20), (400, None)])
    later = make_policy("cmlfq", B, min_samples=1, center=None)
    later.fit(train)
    first = replay(later, [a, b]).decision_accuracy
    assert replay(later, [c]).decision_accuracy > first


def test_online_siblings_switch_controls_when_finishes_reach_the_tree():
    t = traj("a", "q", 1, 50, [(10, 20), (10, None)])
    off = make_policy("cmlfq", B)
    off.finish(t)
    assert off.tree.lookup("q", []).count == 0
    off.end_step()
    assert off.tree.lookup("q", []).count == 1
    on = make_policy("cmlfq", B, online_siblings=True)
    on.finish(t)
    assert on.tree.lookup("q", []).count == 1
    # Without end_step calls, a newer step's finish flushes the held ones.
    off2 = make_policy("cmlfq", B)
    off2.finish(t)
    off2.finish(traj("b", "q", 2, 50, [(10, None)]))
    assert off2.tree.lookup("q", []).count == 1


def test_periodic_rebuild_bounds_the_tree_to_recent_trajectories():
    pol = make_policy("cmlfq", B, rebuild_every=4, rebuild_window=3, online_siblings=True)
    for i in range(8):
        pol.finish(traj(f"t{i}", f"p{i}", 0, 50, [(10, None)]))
    assert pol.tree.lookup("zz", []).count == 3  # rebuilt after the 8th from the last 3


def test_baselines():
    rr = make_policy("round_robin", B)
    req = RequestInfo("t", "p", 10, 10, 0, ())
    assert [rr.start(req) for _ in range(4)] == [0, 1, 2, 0]
    ll = make_policy("least_loaded", B)
    picks = [ll.start(RequestInfo(f"t{i}", "p", 10, 10, 0, ())) for i in range(3)]
    assert sorted(picks) == [0, 1, 2]
    ll.finish(traj("t1", "p", 0, 10, [(5, None)]))
    assert ll.start(RequestInfo("t9", "p", 10, 10, 0, ())) == picks[1]
    pred = make_policy("predictor", B)
    # Prompts recur over steps, so the regressor learns how much a prompt's own history tells.
    pred.fit([traj(f"h{s}-{i}", "long", s, 50, [(300, None)]) for s in range(3) for i in range(6)]
             + [traj(f"s{s}-{i}", "short", s, 50, [(10, None)]) for s in range(3) for i in range(6)])
    assert pred.start(RequestInfo("x", "long", 50, 50, 0, ())) == 2
    assert pred.start(RequestInfo("y", "short", 50, 50, 0, ())) == 0
    # ...and it never moves a request afterwards.
    assert pred.tool_return(RequestInfo("y", "short", 50, 350, 300, (ToolReturn("s", 1),)), 0) == 0


def _requests(t, with_contexts):
    return decision_points(t, with_contexts)


def _decisions(pol, trajs, with_contexts):
    out = []
    for t in trajs:
        reqs = _requests(t, with_contexts)
        b = pol.start(reqs[0])
        out.append(b)
        for r in reqs[1:]:
            b = pol.tool_return(r, b)
            out.append(b)
    return out


def test_policy_tracks_decision_contexts_itself_and_survives_a_tree_swap():
    import random

    from areal_libra.cmlfq import PrefixTree

    rng = random.Random(0)
    hist, probe = [], []
    for i in range(300):
        segs = [(rng.randint(5, 60), rng.choice([5, 40, 900]), rng.choice(["success", "failure"]))
                for _ in range(rng.randint(0, 3))] + [(rng.randint(5, 200), None)]
        (hist if i < 200 else probe).append(traj(f"t{i}", f"p{i % 7}", 0 if i < 200 else 1, 30, segs))
    a = make_policy("cmlfq", [300, 1000, 3000], center=None, min_samples=3)
    b = make_policy("cmlfq", [300, 1000, 3000], center=None, min_samples=3)
    a.fit(hist)
    b.fit(hist)
    with_ctx = _decisions(a, probe, True)
    assert _decisions(b, probe, False) == with_ctx  # the simulator's calls carry no contexts
    assert len(set(with_ctx)) > 1
    # A rebuilt tree swapped in (as the live tree does) decides like the original.
    fresh = PrefixTree(min_samples=3)
    fresh.rebuild(hist)
    b.tree = fresh
    assert _decisions(b, probe, True) == with_ctx
