"""Workload generators and replays: the shapes the issue asks for, drift, and bad input."""

import logging
import random

import numpy as np
import pytest

from areal_libra.sim.cluster import Layout, RunConfig, Simulation, TrainLayout
from areal_libra.sim.hardware import truth_for
from areal_libra.sim.workloads import WorkloadConfig, make_workload
from areal_libra.trace import Segment, ToolReturn, TraceError, Trajectory, write_traces


def _sample(wl, version, n=120, seed=0):
    rng = random.Random(seed)
    return [t for _ in range(n) for t in wl.sample_group(version, rng)]


def test_r2e_gym_many_tool_turns_retries_and_a_heavy_tail():
    wl = make_workload("r2e_gym")
    trajs = _sample(wl, 0)
    tools = [s.tool for t in trajs for s in t.segments if s.tool]
    assert np.mean([len(t.segments) for t in trajs]) >= 4
    assert {t.name for t in tools} == {"bash", "python", "file_view"}
    assert max(t.payload_tokens for t in tools if t.name == "file_view") > 4000
    assert any(t.status != "success" for t in tools)
    # a failed call is followed by a retry turn that calls the same tool
    retried = [(a.tool, b.tool) for t in trajs for a, b in zip(t.segments, t.segments[1:])
               if a.tool and a.tool.status != "success" and b.tool]
    assert retried and all(x.name == y.name for x, y in retried)
    # heavy tail: in a simulated run, the longest 10% of trajectories take > 50% of rollout time
    # (all trajectories started in the first 3 steps; strict staleness makes sure they all finished)
    sim = Simulation(truth_for("a800", "qwen3-14b"), wl, 48, Layout(TrainLayout(8, 1, 3), [(2, 0)] * 12),
                     RunConfig(max_staleness=4, strict_staleness=True), seed=1)
    sim.run(12)
    d = np.array([x for x, v in zip(sim.traj_durations, sim.traj_versions) if v <= 2])
    assert len(d) == 7 * wl.cfg.batch_prompts * wl.cfg.group_size  # versions 0..2 admit 5+1+1 batches
    d = np.sort(d)[::-1]
    assert d[: len(d) // 10].sum() / d.sum() > 0.5


def test_dapo_math_cap_hits_and_lengths_grow():
    wl = make_workload("dapo_math")
    early, late = _sample(wl, 0, 60), _sample(wl, wl.cfg.horizon, 60)
    assert all(1 <= len(t.segments) <= 2 for t in early)
    hits = [t for t in early if t.finish_reason == "length"]
    assert hits and all(t.model_tokens == 20480 for t in hits)
    assert np.mean([t.model_tokens for t in late]) > 1.2 * np.mean([t.model_tokens for t in early])
    assert np.mean([t.final_length for t in early]) == pytest.approx(9700, rel=0.25)  # mixture mean ~9.6K


def test_search_r1_replays_polytrace_with_length_scale():
    wl = make_workload("search_r1", WorkloadConfig(group_size=8, batch_prompts=4, length_scale=2.0, drift=0.0))
    g = wl.sample_group(0, random.Random(0))
    assert len(g) == 8 and len({t.prompt_id for t in g}) == 1
    orig = wl.groups[0]
    pid = g[0].prompt_id
    base = next(grp for grp in orig if grp[0].prompt_id == pid)
    for new, old in zip(g, base):
        # a trajectory cut off right after a tool call ends there (its last tool return is dropped)
        assert [s.tool for s in new.segments[:-1]] == [s.tool for s in old.segments[:-1]]
        assert [s.gen_tokens for s in new.segments] == [max(1, round(s.gen_tokens * 2.0)) for s in old.segments]


def test_any_canonical_trace_is_a_workload(tmp_path):
    trajs = [Trajectory(f"t{i}", f"p{i % 3}", 0, 100, (Segment(50, ToolReturn("search", 30, "success", 0.1)),
                                                        Segment(20, None))) for i in range(9)]
    path = tmp_path / "tr.jsonl"
    write_traces(path, trajs)
    wl = make_workload(str(path))
    g = wl.sample_group(0, random.Random(1))
    assert len(g) == 3 and len({t.prompt_id for t in g}) == 1 and g[0].final_length == 200


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.text = ""

    def emit(self, record: logging.LogRecord) -> None:
        self.text += self.format(record) + "\n"


@pytest.fixture
def workload_log():
    """The records of the workloads module's own logger object, through a handler on it: other tests' logging
    set-up (a dictConfig, a replaced logger manager) can keep them from the root's caplog handler."""
    from areal_libra.sim import workloads

    logger = workloads.log
    handler = _Lines()
    disabled, logger.disabled = logger.disabled, False
    level = logger.level
    logger.setLevel(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.disabled = disabled


def _trace_folder(tmp_path, per_step):
    """A folder of canonical traces, step s holding per_step[s] trajectories (groups of 2)."""
    for s, n in enumerate(per_step):
        trajs = [Trajectory(f"s{s}t{i}", f"s{s}p{i // 2}", s, 100, (Segment(50 + s, None),)) for i in range(n)]
        write_traces(tmp_path / f"step_{s}.jsonl", trajs)
    return tmp_path


def test_a_stub_last_step_is_left_out_of_a_replay_and_said(tmp_path, workload_log):
    # PolyTrace Search-R1's step 5 holds 47 trajectories of 2,048: replayed after the trace's end it would
    # repeat a few prompts for the rest of a run
    folder = _trace_folder(tmp_path, [40, 40, 40, 2])
    wl = make_workload(str(folder))
    assert wl.steps == [0, 1, 2]
    assert "step 3 holds 2 trajectories" in workload_log.text and str(folder) in workload_log.text
    assert wl.sample_group(9, random.Random(0))[0].segments[0].gen_tokens == 52  # the last full step


def test_full_steps_are_all_replayed(tmp_path, workload_log):
    wl = make_workload(str(_trace_folder(tmp_path, [40, 40, 40, 4])))  # a tenth of the median: kept
    assert wl.steps == [0, 1, 2, 3] and "left out" not in workload_log.text


def test_bad_workloads_fail_clearly(tmp_path):
    with pytest.raises(ValueError, match="unknown workload 'nope'"):
        make_workload("nope")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"trajectory_id": "a", "prompt_id": "p", "step": 0, "prompt_tokens": 5, "segments": []}\n')
    with pytest.raises(TraceError, match=r"bad.jsonl:1: field 'segments'"):
        make_workload(str(bad))
    with pytest.raises(TraceError, match="no such trace file"):
        make_workload(str(tmp_path / "missing.jsonl"))
