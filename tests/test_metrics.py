"""metrics.jsonl: one flat record per step with reward, throughput and tool counts."""

import json

from areal_libra.metrics import StepMetrics
from areal_libra.trace import Segment, ToolReturn, Trajectory


def _traj(i: int, status: str, reward: float) -> Trajectory:
    segs = (Segment(10, ToolReturn("calculator", 3, status)), Segment(5, None))
    return Trajectory(f"t{i}", "p", 0, 20, segs, "stop", reward)


def test_step_records(tmp_path) -> None:
    m = StepMetrics(tmp_path / "metrics.jsonl", total_steps=2)
    m.add_source(lambda: {"cmlfq/migrations": 3})
    m.on_trajectory(_traj(0, "success", 1.0))
    m.on_trajectory(_traj(1, "failure", 0.0))
    m.on_trajectory(_traj(2, "timeout", 0.0))
    m.on_commit(0, {"ppo_actor/task_reward/avg": 0.25, "rollout/reward": 0.5, "timeperf/rollout": 1.5,
                    "bad": float("nan")})
    m.on_commit(1, {})  # nothing trained, nothing finished: the episodes' mean is absent too
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2]
    a, b = recs
    assert a["reward"] == 0.25  # the trained batch's task reward wins over the rollout-side mean
    assert (a["trajectories"], a["gen_tokens"]) == (3, 45)
    assert (a["tool_calls"], a["tool_failures"], a["tool_timeouts"]) == (3, 1, 1)
    assert a["throughput_tokens_per_s"] > 0 and a["cmlfq/migrations"] == 3
    assert a["timeperf/rollout"] == 1.5 and "bad" not in a
    assert b["reward"] is None and b["gen_tokens"] == 0 and b["tool_calls"] == 0


def test_the_first_step_leaves_out_what_came_before_start_clock(tmp_path) -> None:
    # The profiling pass before step 1 is no step's time (the controller's measured step time would count it).
    import time

    m = StepMetrics(tmp_path / "metrics.jsonl", total_steps=1)
    time.sleep(0.4)
    m.start_clock()
    m.on_commit(0, {})
    rec = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert rec["step_time_s"] < 0.3 and rec["time_s"] >= 0.4
