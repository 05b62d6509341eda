"""A failed reconfiguration never ends the trainer: the controller runs in AReaL's stats hook, so the first
plan that cannot be applied (e.g. the fleet refused it) or any failure of a control step is recorded in
control_events.jsonl with its reason and the layout in force keeps serving."""

from __future__ import annotations

import json
from pathlib import Path

from areal_libra.control import ControlConfig
from areal_libra.live.live_cluster import LiveCluster, LiveControl
from areal_libra.planner.replan import ReplanConfig
from areal_libra.rollout.fleet import FleetError
from areal_libra.rollout.groups import RolloutGroup
from tests.live.test_recover_state import _plan, _rec

LAUNCH = RolloutGroup("tp1", tp=1, count=2, max_len=4096)  # the launch layout: 2 x TP1


class RefusingFleet:
    """The fleet's answer to a layout it cannot start (FleetError: the old layout still serves)."""

    def __init__(self) -> None:
        self.groups = [LAUNCH]
        self.asked: list[list[tuple[int, int]]] = []

    def reconfigure(self, groups, step):
        self.asked.append([(g.tp, g.count) for g in groups])
        raise FleetError("reconfigure: cannot start TP2 (tp2): no free device")


class Source:
    def __init__(self, plans) -> None:
        self.plans = list(plans)

    def solve(self, history):
        p = self.plans.pop(0) if len(self.plans) > 1 else self.plans[0]
        if isinstance(p, Exception):
            raise p
        return p

    def price(self, plan, history):
        return plan.makespan_s


def _control(tmp_path: Path, fleet, plans) -> LiveControl:
    cluster = LiveCluster(fleet, None, groups=[LAUNCH])
    cluster.finished.extend([(10, 100)] * 32)
    cfg = ControlConfig(replan_policy=ReplanConfig(every_k=4), settle_steps=4, interval_window=4, min_history=16,
                        history=64)
    return LiveControl(cfg, Source(plans), cluster, events_path=tmp_path / "control_events.jsonl")


def _events(tmp_path: Path) -> list[dict]:
    return [json.loads(x) for x in (tmp_path / "control_events.jsonl").read_text().splitlines()]


def test_a_first_plan_the_fleet_refuses_leaves_the_launch_layout_serving(tmp_path: Path) -> None:
    fleet = RefusingFleet()
    control = _control(tmp_path, fleet, [_plan(tp=2, count=1)])
    out = control.on_step(1, _rec(1))  # the first plan; the fleet refuses it - no exception reaches AReaL
    assert fleet.asked == [[(2, 1)]]
    ev = _events(tmp_path)
    assert [e["event"] for e in ev] == ["initial_plan", "reconfig_failed"]
    assert "no free device" in ev[1]["detail"] and "rollout 2xTP1 keeps serving" in ev[1]["detail"]
    assert [(g.tp, g.count) for g in control.cluster.groups] == [(1, 2)] and control.cluster.reconfigs == 0
    assert control.ctl is not None and out["plan/reconfigurations"] == 0.0
    # The controller holds the plan it could not apply; the cluster knows that plan does not serve, so a
    # re-plan to it is a change to try again, not "nothing to move".
    assert not control.cluster.same_layout(control.ctl.plan, _plan(tp=2, count=1))
    for step in range(2, 6):
        control.on_step(step, _rec(step))  # the run goes on


def test_any_failure_of_a_control_step_is_recorded_and_the_run_goes_on(tmp_path: Path) -> None:
    control = _control(tmp_path, None, [RuntimeError("the cost model broke\nsecond line"), _plan(tp=1, count=2)])
    out = control.on_step(1, _rec(1))
    assert control.failures == 1 and control.ctl is None and "plan/reconfig_s" in out
    (ev,) = _events(tmp_path)
    assert ev["event"] == "control_failed" and ev["detail"] == (
        "RuntimeError: the cost model broke; the layout in force keeps serving")
    control.on_step(2, _rec(2))  # the next step plans again, and succeeds
    assert control.ctl is not None and control.failures == 1
    assert [e["event"] for e in _events(tmp_path)] == ["control_failed", "initial_plan"]


class DroppingFleet:
    """An xccl fleet whose change was dropped at the weight update: the old layout still serves."""

    def __init__(self) -> None:
        self.groups, self.pending = [LAUNCH], False

    def reconfigure(self, groups, step):
        self.pending = True  # the new servers wait for the next update
        return {"started": ["h:1"], "stopped": [], "pending": True}


def test_a_change_dropped_at_the_weight_update_leaves_the_controller_on_the_serving_layout(tmp_path) -> None:
    fleet = DroppingFleet()
    control = _control(tmp_path, fleet, [_plan(tp=2, count=1)])
    control.on_step(1, _rec(1))
    assert [(g.tp, g.count) for g in control.cluster.groups] == [(2, 1)]  # applied: waits for the update
    control.on_step(2, _rec(2))  # still waiting: nothing to take back
    assert [(g.tp, g.count) for g in control.cluster.groups] == [(2, 1)]
    fleet.pending = False  # the update came; the new servers did not join; fleet.groups is still the launch's
    control.on_step(3, _rec(3))
    assert [(g.tp, g.count) for g in control.cluster.groups] == [(1, 2)]
    assert not control.cluster.same_layout(control.ctl.plan, _plan(tp=2, count=1))  # a re-plan may try again
