"""The Dispatcher plug point: placement, migration accounting, least-loaded servers, health, and the same
decisions as the routing replay on real traces."""

import threading
from pathlib import Path

import pytest

from areal_libra.cmlfq import Dispatcher, NoHealthyServer, ServerGroup, make_policy
from areal_libra.cmlfq.replay import replay
from areal_libra.trace import Segment, ToolReturn, Trajectory, read_traces

POLY = Path("/work/shared/data/polytrace/search_r1")
B = [100, 200, 400]


def groups():
    return [ServerGroup("tp4", 4, 400, ["c0"]), ServerGroup("tp1", 1, 100, ["a0", "a1"]),
            ServerGroup("tp2", 2, 200, ["b0", "b1"])]


def meta(tid, ctx, tools=(), prompt="p", turn=None):
    return {"trajectory_id": tid, "prompt_id": prompt, "turn": len(tools) if turn is None else turn,
            "prompt_tokens": 50, "context_tokens": ctx, "model_tokens": 0, "tool_returns": list(tools)}


def test_groups_sorted_and_checked():
    d = Dispatcher(make_policy("mlfq", B), groups())
    assert [g.name for g in d.groups] == ["tp1", "tp2", "tp4"]
    with pytest.raises(ValueError, match="buckets"):
        Dispatcher(make_policy("mlfq", [100, 200]), groups())
    with pytest.raises(ValueError, match="two groups"):
        Dispatcher(make_policy("mlfq", [1, 2]), [ServerGroup("x", 1, 1, ["s"]), ServerGroup("y", 1, 2, ["s"])])


def test_trajectory_keeps_group_until_a_tool_return_moves_it():
    d = Dispatcher(make_policy("mlfq", B), groups())
    assert d.route(meta("t", 50)) in ("a0", "a1")
    tool = {"name": "search", "payload_tokens": 70, "status": "success"}
    # Same turn again (a retry of the same request): no new tool return, no move even though ctx > 100.
    assert d.route(meta("t", 150, turn=0)) in ("a0", "a1")
    assert d.metrics()["migrations"] == 0
    assert d.route(meta("t", 150, [tool])) in ("b0", "b1")  # MLFQ: 150 overruns 100
    m = d.metrics()
    assert (m["migrations"], m["migrated_tokens"], m["routed"]) == (1, 150, 3)
    assert m["trajectories/tp2"] == 1
    d.finish({"trajectory_id": "t"})
    assert d.metrics()["active_trajectories"] == 0


def test_least_loaded_server_within_group_and_health():
    d = Dispatcher(make_policy("mlfq", B), groups())
    first = d.route(meta("t1", 50))
    d.begin(first)
    second = d.route(meta("t2", 50))
    assert {first, second} == {"a0", "a1"}
    d.begin(second)
    d.end(first)
    assert d.route(meta("t3", 50)) == first
    d.mark_unhealthy("a0")
    d.mark_unhealthy("a1")
    assert d.route(meta("t4", 50)) in ("b0", "b1")  # falls to the next bucket
    assert d.metrics()["fallbacks"] == 1
    for a in ("b0", "b1", "c0"):
        d.mark_unhealthy(a)
    with pytest.raises(NoHealthyServer):
        d.route(meta("t5", 50))
    d.mark_healthy("a1")
    assert d.route(meta("t5", 50)) == "a1"


def test_sticky_keeps_server_inside_group():
    d = Dispatcher(make_policy("mlfq", B), groups(), sticky=True)
    a = d.route(meta("t", 50))
    d.begin(a)
    d.begin(a)
    assert d.route(meta("t", 60, [ToolReturn("search", 5)])) == a


def test_finish_with_trajectory_feeds_the_policy_and_least_loaded_uses_real_load():
    pol = make_policy("cmlfq", B, online_siblings=True)
    d = Dispatcher(pol, groups())
    t = Trajectory("t", "p", 0, 50, (Segment(10, ToolReturn("search", 20)), Segment(5, None)))
    d.route(meta("t", 50))
    d.finish(t)
    assert pol.tree.lookup("p", []).count == 1
    d.finish(t.to_json())  # a canonical dict works too
    assert pol.tree.lookup("p", []).count == 2
    ll = Dispatcher(make_policy("least_loaded", B), groups())
    for addr in ("a0", "a1", "b0", "b1"):
        ll.begin(addr)
    assert ll.route(meta("x", 50)) == "c0"


def test_bad_metadata_is_a_clear_error():
    d = Dispatcher(make_policy("mlfq", B), groups())
    with pytest.raises(ValueError, match="trajectory_id"):
        d.route({"prompt_id": "p"})


def test_concurrent_routing_is_consistent():
    d = Dispatcher(make_policy("round_robin", B), groups())

    def work(k):
        for i in range(200):
            addr = d.route(meta(f"{k}-{i}", 50))
            d.begin(addr)
            d.end(addr)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    m = d.metrics()
    assert m["routed"] == 800 and m["active_trajectories"] == 800
    assert sum(m[f"inflight/{g}"] for g in ("tp1", "tp2", "tp4")) == 0


@pytest.mark.skipif(not POLY.is_dir(), reason="PolyTrace data not present")
def test_dispatcher_makes_the_replays_decisions_on_real_traces():
    train = read_traces(POLY / "step_0.jsonl.gz")
    evals = read_traces(POLY / "step_3.jsonl.gz")[:600]
    buckets = [1536, 3072, 7168]
    ref = make_policy("cmlfq", buckets)
    ref.fit(train)
    want = replay(ref, evals)
    pol = make_policy("cmlfq", buckets)
    pol.fit(train)
    gs = [ServerGroup(f"g{i}", 2 ** i, b, [f"s{i}"]) for i, b in enumerate(buckets)]
    d = Dispatcher(pol, gs)
    correct = decisions = 0
    for t in evals:
        oracle = pol.bucket_of(t.final_length)
        ctx, model, tools = t.prompt_tokens, 0, []
        for turn, seg in enumerate(t.segments):
            addr = d.route({"trajectory_id": t.trajectory_id, "prompt_id": t.prompt_id, "turn": turn, "step": t.step,
                            "prompt_tokens": t.prompt_tokens, "context_tokens": ctx, "model_tokens": model,
                            "tool_returns": [{"name": r.name, "payload_tokens": r.payload_tokens,
                                              "status": r.status} for r in tools]})
            if turn == 0 or t.segments[turn - 1].tool is not None:
                decisions += 1
                correct += int(addr[1:]) == oracle
            ctx += seg.gen_tokens
            model += seg.gen_tokens
            if seg.tool is not None:
                ctx += seg.tool.payload_tokens
                tools.append(seg.tool)
        if t.segments[-1].tool is not None:  # a decision after the last tool return: the replay makes it too
            addr = d.route({"trajectory_id": t.trajectory_id, "prompt_id": t.prompt_id, "turn": len(t.segments),
                            "step": t.step, "prompt_tokens": t.prompt_tokens, "context_tokens": ctx,
                            "model_tokens": model,
                            "tool_returns": [{"name": r.name, "payload_tokens": r.payload_tokens,
                                              "status": r.status} for r in tools]})
            decisions += 1
            correct += int(addr[1:]) == oracle
    for t in evals:
        d.finish(t)
    assert decisions == want.n_decisions
    assert correct / decisions == pytest.approx(want.decision_accuracy)
    assert d.metrics()["migrations"] == round(want.migrations_per_trajectory * len(evals))
