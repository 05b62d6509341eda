"""The C++ and Python prefix-tree cores give identical results on the real PolyTrace traces."""

from pathlib import Path

import pytest

from areal_libra.cmlfq import PrefixTree, cpp_available, decision_contexts, tool_state
from areal_libra.trace import read_traces

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


@pytest.mark.parametrize("switches", [{}, {"center": None, "move_cost": 0.0, "overrun": True, "state_key": "status"},
                                      {"center": 0.5, "move_cost": 0.5, "overrun": True, "state_key": "",
                                       "drift": True, "growth": 0.5}])
def test_policy_decisions_agree_between_backends(trajs, switches):
    from areal_libra.cmlfq import make_policy
    from areal_libra.cmlfq.replay import _Acc, route_trajectory

    buckets = [1536, 3072, 7168]
    pols = {b: make_policy("cmlfq", buckets, backend=b, **switches) for b in ("python", "cpp")}
    seen = {b: [] for b in pols}
    for b, pol in pols.items():
        pol.fit([t for t in trajs if t.step <= 1])
        start, tool_return = pol.start, pol.tool_return
        pol.start = lambda req, f=start, out=seen[b]: out.append(f(req)) or out[-1]
        pol.tool_return = lambda req, cur, f=tool_return, out=seen[b]: out.append(f(req, cur)) or out[-1]
        for t in [t for t in trajs if t.step == 3][:1000]:
            route_trajectory(pol, t, _Acc(), False)
    assert len(seen["cpp"]) > 2000
    assert seen["python"] == seen["cpp"]
    assert len(set(seen["cpp"])) > 1  # the decisions are not all the same bucket
