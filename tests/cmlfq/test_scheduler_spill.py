"""Load-aware spill-over between buckets: the pure rule, and the Dispatcher switch (off by default)."""

import pytest

from areal_libra.cmlfq import Dispatcher, ServerGroup, make_policy
from areal_libra.cmlfq.spill import SpillConfig, spill

B = [100, 200, 400]


def test_rule_spills_only_when_much_more_loaded():
    cfg = SpillConfig(ratio=1.5, slack=1.0)
    assert spill(1, [0.0, 2.0, 0.0], cfg) == 2  # 2 > 1.5*0 + 1: both neighbours qualify, tie -> larger
    assert spill(1, [0.0, 1.0, 0.0], cfg) == 1  # within slack: stays
    assert spill(0, [10.0, 3.0, 0.0], cfg) == 2  # any larger bucket: the least loaded
    assert spill(0, [10.0, 9.0, 0.0], cfg) == 2  # the neighbour as full as the target does not strand it
    assert spill(0, [10.0, 9.0, 0.0], SpillConfig(up_any=False)) == 0  # one position up only: stranded
    assert spill(0, [12.0, 6.0, 0.0], SpillConfig(up_any=False)) == 1
    assert spill(0, [10.0, 0.0, 0.0], cfg) == 1  # ties: the nearer bucket
    assert spill(2, [0.0, 9.0, 20.0], cfg) == 1  # below the target: `reach` (1) positions only
    assert spill(2, [0.0, 9.0, 6.0], cfg) == 2  # 6 < 1.5*9 + 1: the neighbour is busier
    assert spill(1, [3.0, 8.0, 5.0], cfg) == 0  # both qualify, the least loaded wins
    assert spill(5, [1.0], cfg) == 5  # out-of-range target is left to the caller's clamp
    with pytest.raises(ValueError, match="ratio"):
        SpillConfig(ratio=0.5)


def _groups():
    return [ServerGroup("tp1", 1, 100, ["a0", "a1"]), ServerGroup("tp2", 2, 200, ["b0"]),
            ServerGroup("tp4", 4, 400, ["c0"])]


def _meta(tid, ctx=50):
    return {"trajectory_id": tid, "prompt_id": "p", "turn": 0, "prompt_tokens": 50, "context_tokens": ctx,
            "model_tokens": 0, "tool_returns": []}


def _load_bucket0(d):
    d.route(_meta("x0"))  # placed while everything is idle
    for addr in ("a0", "a1") * 3:  # 6 in flight on 2 TP1 GPUs: 3 per GPU vs 0 elsewhere
        d.begin(addr)


def test_dispatcher_spill_is_a_switch():
    off = Dispatcher(make_policy("mlfq", B), _groups())  # MLFQ starts everything in the shortest bucket
    _load_bucket0(off)
    assert off.route(_meta("new")) in ("a0", "a1")
    assert off.metrics()["spills"] == 0
    on = Dispatcher(make_policy("mlfq", B), _groups(), spill=SpillConfig(ratio=1.5, slack=1.0))
    _load_bucket0(on)
    assert on.route(_meta("new")) == "b0"  # spilled to the neighbouring (TP2) group
    assert on.metrics()["spills"] >= 1
    assert on.placement("new") == (1, 1)
    # A request that stays in its bucket is never spilled (it keeps its cached context).
    assert on.route(_meta("x0", ctx=60)) in ("a0", "a1")
