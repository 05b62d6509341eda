"""The C++ and Python prefix-tree cores give identical results on the real PolyTrace traces, decision by
decision, with every switch auto mode chooses from (drift, growth, window, state key, rule)."""

import gc
import random
import weakref
from dataclasses import replace
from pathlib import Path

import pytest

from areal_libra.cmlfq import PrefixTree, RequestInfo, cpp_available, decision_contexts, make_policy, tool_state
from areal_libra.cmlfq.drift import GrowthTable, LengthDrift
from areal_libra.cmlfq.replay import _Acc, decision_points, route_trajectory
from areal_libra.trace import ToolReturn, read_traces

POLY = Path("/work/shared/data/polytrace/search_r1")

pytestmark = [
    pytest.mark.skipif(not cpp_available(), reason="C++ prefix tree not built (pip install -e . with a compiler)"),
    pytest.mark.skipif(not POLY.is_dir(), reason="PolyTrace data not present"),
]


@pytest.fixture(scope="module")
def trajs():
    return read_traces([POLY / f"step_{i}.jsonl.gz" for i in range(5)])


@pytest.mark.parametrize("max_nodes,window", [(200_000, 200), (2_500, 31)])
def test_backends_agree_on_real_traces(trajs, max_nodes, window, tmp_path):
    py = PrefixTree(min_samples=4, window=window, max_nodes=max_nodes, backend="python")
    cc = PrefixTree(min_samples=4, window=window, max_nodes=max_nodes, backend="cpp")
    probes = 0
    for i, t in enumerate(trajs):
        py.insert(t)
        cc.insert(t)
        if i % 3 == 0:  # interleave lookups: they move the LRU clock too
            states = [tool_state(r) for r in t.tool_returns()]
            ctx = decision_contexts(t)
            for k in range(len(states) + 1):
                floors = [ctx[k] - c for c in ctx[: k + 1]]
                args = (t.prompt_id.replace("s", "x", i % 2), states[:k])
                for kw in ({}, {"q": 0.3, "floors": floors, "prompt_first": True}):
                    assert py.lookup(*args, **kw) == cc.lookup(*args, **kw)
                    probes += 1
    assert probes > 10_000
    assert py.node_count() == cc.node_count() <= max_nodes
    assert py.dump() == cc.dump()
    py.save(tmp_path / "py.tree")
    cc.save(tmp_path / "cc.tree")
    assert (tmp_path / "py.tree").read_bytes() == (tmp_path / "cc.tree").read_bytes()


# The fixed defaults; auto mode (the default: it chooses drift, growth 0.5, window 50 and a depth-only key on
# these steps); those switches pinned; and the rule/tree switches auto validates, in other combinations.
AUTO_SWITCHES = {"auto": False, "drift": True, "growth": 0.5, "window": 50, "state_key": ""}


@pytest.mark.parametrize("switches", [
    {"auto": False}, {}, AUTO_SWITCHES,
    {**AUTO_SWITCHES, "online_siblings": True, "center": None, "overrun": True},
    {"center": None, "overrun": True, "state_key": "status"},
    {"center": 0.5, "overrun": True, "state_key": "", "drift": True, "growth": 0.5},
    {"auto": False, "growth": 0.5, "window": 50, "condition": False, "prompt_first": False},
])
def test_policy_decisions_agree_between_backends(trajs, switches):
    buckets = [1536, 3072, 7168]
    seen = {}
    for b in ("python", "cpp"):
        pol = make_policy("cmlfq", buckets, backend=b, **switches)
        out = seen[b] = []
        start, tool_return = pol.start, pol.tool_return
        pol.start = lambda req, f=start, out=out: out.append(f(req)) or out[-1]
        pol.tool_return = lambda req, cur, f=tool_return, out=out: out.append(f(req, cur)) or out[-1]
        pol.fit([t for t in trajs if t.step <= 1])
        for step in (2, 3):  # route a step, then learn it: the drift/growth state is re-installed at the boundary
            for t in [t for t in trajs if t.step == step][:500]:
                route_trajectory(pol, t, _Acc(), False)
                pol.finish(t)
            pol.end_step()
        out.append(pol.auto_choice.as_dict() if pol.auto_choice else None)
    assert len(seen["cpp"]) > 2000
    assert seen["python"] == seen["cpp"]
    assert len(set(seen["cpp"][:-1])) > 1  # the decisions are not all the same bucket
    if switches == {}:
        # Auto chose (and both cores chose alike); the drift/growth paths are the explicit switch sets below.
        assert seen["cpp"][-1] is not None and seen["cpp"][-1]["folds"] > 0


def test_request_scale_agrees_between_backends(trajs):
    """The per-decision multiplier (drift level x growth factor) is computed in the core from the state
    installed at the step boundary: both cores give the same double, for tagged, untagged and past steps."""
    pols = {b: make_policy("cmlfq", [1536, 3072, 7168], backend=b, **AUTO_SWITCHES) for b in ("python", "cpp")}
    for pol in pols.values():
        pol.fit([t for t in trajs if t.step <= 2])
    assert pols["cpp"].drift.rate != 0
    scales = {b: [] for b in pols}
    for t in [t for t in trajs if t.step == 3][:300]:
        for req in decision_points(t):
            for step in (0, 2, 3, 7):
                for b, pol in pols.items():
                    scales[b].append(pol.tree.request_scale(req.prompt_id, step, len(req.tool_returns),
                                                            req.context_tokens, req.prompt_tokens))
    assert scales["python"] == scales["cpp"]
    assert len(set(scales["cpp"])) > 100


def test_growth_tables_agree():
    """drift.GrowthTable (the reference) and the C++ GrowthCore: same sums in the same order, same
    eviction of the least recently updated prompt, same depth cap."""
    from areal_libra import _prefix_tree

    rng = random.Random(4)
    py, cc = GrowthTable(max_prompts=7, max_depth=5), _prefix_tree.GrowthCore(max_prompts=7, max_depth=5)
    for _ in range(3000):
        pid, ptok = f"p{rng.randrange(12)}", rng.randrange(10, 500)
        ctx = [ptok]
        for _ in range(rng.randrange(0, 9)):
            ctx.append(ctx[-1] + rng.randrange(1, 3000))
        scale = rng.choice([1.0, 0.83, 1.37])
        py.add(pid, ptok, ctx, scale)
        cc.add(pid, ptok, ctx, scale)
    probes = [(f"p{i}", d) for i in range(14) for d in range(0, 8)]
    assert [py.typical(*q) for q in probes] == [cc.typical(*q) for q in probes]
    assert sum(py.typical(*q) is None for q in probes) > 0 and cc.prompt_count() == 7
    py.clear()
    cc.clear()
    assert py.typical("p1", 1) is None and cc.typical("p1", 1) is None


def test_return_state_cache_follows_the_tree(trajs):
    """The C++ core's own return-state cache: unknown states are not cached (they may become known), a
    rebuild re-interns the states and a new state mapping clears it; odd field types go to the resolver;
    decisions agree with the Python path throughout. The core holds its wrapper weakly (a dropped tree is
    freed: no reference cycle through the core)."""
    trees = {b: PrefixTree(backend=b) for b in ("python", "cpp")}
    for tree in trees.values():
        tree.set_rule([1536, 3072, 7168], False, 0.3, False, True, True)
        tree.set_scaling(None, None, 0.0)
    cc = trees["cpp"]
    calls = []
    resolve = cc.resolve_return
    cc._core.set_resolver(lambda: lambda tool: calls.append(tool) or resolve(tool))
    train = [t for t in trajs if t.step == 0][:600]
    odd = ToolReturn("never_seen_tool", 120, "success")
    with_odd = [replace(t, prompt_id=f"odd{i}", segments=tuple(replace(s, tool=odd) if s.tool is not None else s
                                                                for s in t.segments))
                for i, t in enumerate(t for t in train if t.tool_returns())][:8]
    reqs = [r for t in trajs if t.step == 1 for r in decision_points(t)[1:]][:1500]
    first = reqs[0]
    reqs += [replace(first, tool_returns=(odd,) + first.tool_returns[1:]),
             replace(first, tool_returns=(ToolReturn(first.tool_returns[0].name, 120, None),))]

    def decide_all() -> dict:
        out = {b: [t.request_decider()(r, i % 3, False) for i, r in enumerate(reqs)] for b, t in trees.items()}
        assert out["python"] == out["cpp"]
        return out["cpp"]

    empty = decide_all()
    assert len(calls) == sum(len(r.tool_returns) for r in reqs)  # nothing known: nothing cached
    for tree in trees.values():
        for t in train:
            tree.insert(t)
    calls.clear()
    trained = decide_all()
    assert trained != empty
    # Known states are resolved once each; the unknown tool and the odd status go to the resolver each time.
    n_known = len(calls) - 2
    calls.clear()
    assert decide_all() == trained and len(calls) == 2 and n_known >= 1
    for tree in trees.values():
        tree.rebuild(with_odd + train[::-1])  # new state ids, the odd tool now known
    calls.clear()
    rebuilt = decide_all()
    assert len(calls) > 2  # the cache was dropped with the old ids
    calls.clear()
    assert decide_all() == rebuilt and len(calls) == 1  # only the odd status (not a str) goes uncached
    for tree in trees.values():
        tree.state_map = lambda st: replace(st, size_class="*")
        tree.rebuild(train)
    calls.clear()
    assert decide_all() != rebuilt or len(calls) > 2
    # The core's own resolver is held weakly: a dropped tree is freed (no cycle through the core).
    tree = PrefixTree(backend="cpp")
    tree.set_rule([1536, 3072, 7168], False, 0.3, False, True, True)
    tree.set_scaling(None, None, 0.0)
    tree.insert(train[0])
    tree.request_decider()(first, 0, False)
    ref = weakref.ref(tree)
    del tree
    gc.collect()
    assert ref() is None


def test_fixed_switches_need_no_scaling_state():
    """Without drift and growth the core's multiplier is exactly 1 whatever the request."""
    for b in ("python", "cpp"):
        tree = PrefixTree(backend=b)
        d = LengthDrift()
        tree.set_scaling(d, None, 0.0)  # drift on but nothing fitted yet: level 1
        assert tree.request_scale("p", 5, 2, 4000, 100) == 1.0
        tree.set_scaling(None, tree.growth_table(), 0.0)
        assert tree.request_scale("p", 5, 2, 4000, 100) == 1.0


def test_requests_without_tracked_contexts_agree(trajs):
    """RequestInfo without decision_contexts (a caller that does not track them) takes the same path."""
    out = {}
    for b in ("python", "cpp"):
        pol = make_policy("cmlfq", [1536, 3072, 7168], backend=b, **AUTO_SWITCHES)
        pol.fit([t for t in trajs if t.step <= 1])
        res = []
        for t in [t for t in trajs if t.step == 2][:300]:
            for r in decision_points(t)[1:]:
                bare = RequestInfo(r.trajectory_id + "/bare", r.prompt_id, r.prompt_tokens, r.context_tokens,
                                   r.model_tokens, r.tool_returns, r.step)
                res.append(pol.tool_return(bare, 0))
        out[b] = res
    assert out["python"] == out["cpp"] and len(set(out["cpp"])) > 1
