"""allocation.png's data: the start layout, the layout after each step's decisions, and which decisions changed it."""

from __future__ import annotations

from types import SimpleNamespace

from areal_libra.live.live_cluster import LiveControl
from areal_libra.rollout.emulation import ClusterEmulation
from areal_libra.rollout.groups import RolloutGroup


def test_figure_starts_at_the_start_layout_and_marks_changes(tmp_path):
    lc = LiveControl.__new__(LiveControl)
    lc.accelerators, lc.events_path, lc.decisions, lc.timeline, lc.ctl = 16, None, [], [], None
    emu = ClusterEmulation(accelerators=16, time_scale=2.0)
    lc.cluster = SimpleNamespace(groups=[RolloutGroup("tp4", 4, 2)], emulation=emu, elastic=None, version=0)
    for step in range(1, 5):
        served = lc._layout()
        if step == 1:  # the first plan changes the layout; the step-3 re-plan keeps it
            lc.cluster.groups = [RolloutGroup("tp1", 1, 1), RolloutGroup("tp4", 4, 2)]
            lc._record({"step": 1, "event": "initial_plan", "detail": "x"})
        if step == 3:
            lc._record({"step": 3, "event": "replan", "detail": "y"})
        row = lc._layout()
        row.update(step=step, serving=served, **lc._throughput({"step_time_s": 4.0, "gen_tokens": 1000}))
        lc.timeline.append(row)
    first = lc.timeline[0]
    assert first["serving"] == {"rollout_gpus": 8, "train_gpus": 8, "alloc": "rollout 2xTP4"}
    assert (first["rollout_gpus"], first["train_gpus"]) == (9, 7)
    assert lc._changed_at(1) and not lc._changed_at(3)
    assert first["tokens_per_s"] == 500.0 and first["unit"].startswith("emulated")  # 1000 over 4 s / x2
    out = lc.write_figure(tmp_path / "allocation.png")
    assert out is not None and out.stat().st_size > 1000
