"""The profiling pass and the first plan (control/profile.py), one procedure for the simulator and the live run:
the first plan waits for the whole pass, it is the planner's solve on every trajectory of it, and the live run
starts its controller from it before step 1 (step 0, as the simulator's first plan)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areal_libra.control import ControlConfig, LibraController, ProfileError, ProfilePass
from areal_libra.live.live_cluster import LiveCluster, LiveControl
from areal_libra.rollout.groups import RolloutGroup
from tests.live.test_recover_state import _plan, _rec


class T:
    def __init__(self, prompt: int, final: int) -> None:
        self.prompt_tokens, self.final_length, self.model_tokens = prompt, final, final - prompt


class Recorder:
    """A planner that answers by the longest trajectory it was given (TP2 once the tail is in)."""

    def __init__(self) -> None:
        self.seen: list[list[tuple[int, ...]]] = []

    def solve(self, history):
        self.seen.append(list(history))
        return _plan(tp=2 if max(h[1] for h in history) > 1000 else 1, count=1)

    def price(self, plan, history):
        return plan.makespan_s


def test_the_first_plan_waits_for_the_tail_and_sees_all_of_it() -> None:
    prof = ProfilePass(groups=2, group_size=3)
    prof.extend([T(10, 100)] * 5)  # the tail (the sixth, longest) has not finished
    src = Recorder()
    with pytest.raises(ProfileError, match="5 of 6 trajectories"):
        LibraController.from_profile(ControlConfig(), src, prof)
    assert not src.seen  # nothing solved on a partial pass
    prof.add(T(10, 5000))
    ctl = LibraController.from_profile(ControlConfig(), src, prof)
    assert src.seen == [[(10, 100)] * 5 + [(10, 5000)]] and ctl.plan.instances[0].tp == 2
    assert prof.history(triples=True)[-1] == (10, 5000, 4990)


def test_the_live_controller_starts_from_the_pass_at_step_0(tmp_path: Path) -> None:
    launch = RolloutGroup("tp1", tp=1, count=2, max_len=4096)
    cluster = LiveCluster(None, None, groups=[launch])
    src = Recorder()
    control = LiveControl(ControlConfig(min_history=4, history=64), src, cluster,
                          events_path=tmp_path / "control_events.jsonl")
    control.start_from_profile(ProfilePass(2, 2).extend([T(10, 50), T(10, 60), T(10, 70), T(10, 2000)]))
    ev = [json.loads(x) for x in (tmp_path / "control_events.jsonl").read_text().splitlines()]
    assert [(e["step"], e["event"]) for e in ev] == [(0, "profile"), (0, "initial_plan")]
    assert ev[0]["detail"].startswith("4 of 4 trajectories (2 groups x 2)")
    assert [(g.tp, g.count) for g in cluster.groups] == [(2, 1)]  # applied before step 1
    # The start layout stays in the timeline (the allocation figure begins there), and step 1 already decides.
    assert control.timeline[0]["serving"]["alloc"] == "rollout 2xTP1"
    control.on_step(1, _rec(1))
    assert len(src.seen) == 1 and control.ctl is not None and control.ctl.intervals
    control.write_figure(tmp_path / "allocation.png")
    assert (tmp_path / "allocation.png").stat().st_size > 0
