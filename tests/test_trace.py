"""Canonical trace I/O and the PolyTrace Search-R1 reader (docs/trace-format.md)."""

import gzip
import json
from pathlib import Path

import pytest

from areal_libra.trace import Segment, ToolReturn, TraceError, Trajectory, read_lengths, read_traces, write_traces

POLY = Path("/work/shared/data/polytrace/search_r1")


def _traj(i: int = 0) -> Trajectory:
    return Trajectory(f"t{i}", "p0", 3, 318, (
        Segment(40, ToolReturn("search", 1027, "success", 0.07)),
        Segment(12, ToolReturn("python", 5, "timeout", 1.5)),
        Segment(131, None)), "stop", 1.0)


def test_derived_quantities_follow_the_format_page():
    t = _traj()
    assert t.model_tokens == 40 + 12 + 131
    assert t.context_after(0) == 318 + 40 + 1027
    assert t.final_length == 318 + 40 + 1027 + 12 + 5 + 131
    assert t.remaining_model_tokens(1) == 12 + 131
    assert [r.name for r in t.tool_returns()] == ["search", "python"]


@pytest.mark.parametrize("name", ["a.jsonl", "a.jsonl.gz"])
def test_write_read_round_trip(tmp_path, name):
    trajs = [_traj(i) for i in range(3)]
    write_traces(tmp_path / name, trajs)
    back = read_traces(tmp_path / name)
    assert back == trajs
    assert not list(tmp_path.glob(".*tmp"))  # the temp file is gone after the atomic rename


BAD = [
    ('{"trajectory_id": "a", "prompt_id": "p", "step": 0, "prompt_tokens": 5}', "segments"),
    ('{"trajectory_id": "a", "prompt_id": "p", "step": 0, "prompt_tokens": -1, "segments": [{"gen_tokens": 1}]}',
     "prompt_tokens"),
    ('{"trajectory_id": "a", "prompt_id": "p", "step": 0, "prompt_tokens": 1, "segments": '
     '[{"gen_tokens": 1, "tool": {"name": "s", "payload_tokens": 3, "status": "weird"}}]}', "status"),
    ('{"trajectory_id": "a", "prompt_id": "p", "step": 0, "prompt_tokens": 1, "segments": []}', "segments"),
    ("{not json", "JSON"),
    ('{"step": 0, "turns": [{"turn": 0, "assistant_append_len": 3}], "tool_calls": [{"turn": 0}], '
     '"prompt_group_id": 0, "sample_id": 0, "prompt_len": 3}', "append_len"),
    ('{"step": 0, "turns": [{"turn": 0, "assistant_append_len": 3}], "tool_calls": ["x"], '
     '"prompt_group_id": 0, "sample_id": 0, "prompt_len": 3}', "tool_calls[0]"),
]


@pytest.mark.parametrize("line,field", BAD)
def test_bad_record_names_file_line_and_field(tmp_path, line, field):
    good = json.dumps(_traj().to_json())
    p = tmp_path / "bad.jsonl"
    p.write_text(good + "\n" + line + "\n")
    with pytest.raises(TraceError) as e:
        read_traces(p)
    msg = str(e.value)
    assert f"{p}:2" in msg and field in msg
    stats: dict = {}
    assert len(read_traces(p, skip_bad=True, stats=stats)) == 1
    assert stats["bad_lines"] == 1


def test_truncated_gzip_and_missing_file_are_trace_errors(tmp_path):
    p = tmp_path / "t.jsonl.gz"
    write_traces(p, [_traj(i) for i in range(50)])
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError, match="cannot read"):
        read_traces(p)
    with pytest.raises(TraceError, match="no such trace file"):
        read_traces(tmp_path / "missing.jsonl")


def test_polytrace_record_maps_to_canonical(tmp_path):
    rec = {"step": 4, "prompt_len": 100, "prompt_group_id": 7, "sample_id": 2, "finish_reason": "stop",
           "turns": [{"turn": 1, "assistant_append_len": 20}, {"turn": 0, "assistant_append_len": 10}],
           "tool_calls": [{"turn": 0, "tool_name": "search", "append_len": 300, "status": "success", "latency_s": 0.5},
                          {"turn": 0, "tool_name": "search", "append_len": 200, "status": "api_error", "latency_s": 0.25}]}
    p = tmp_path / "poly.jsonl.gz"
    with gzip.open(p, "wt") as f:
        f.write(json.dumps(rec) + "\n")
    (t,) = read_traces(p)
    assert (t.trajectory_id, t.prompt_id, t.step, t.prompt_tokens) == ("s4-p7-2", "s4-p7", 4, 100)
    assert t.segments[0] == Segment(10, ToolReturn("search", 500, "failure", 0.75))
    assert t.segments[1] == Segment(20, None)
    assert t.final_length == 630


@pytest.mark.skipif(not POLY.is_dir(), reason="PolyTrace data not present")
def test_polytrace_lengths_match_final_total_len():
    path = POLY / "step_0.jsonl.gz"
    trajs = read_traces(path)
    with gzip.open(path, "rt") as f:
        finals = [json.loads(line)["final_total_len"] for line in f if line.strip()]
    assert len(trajs) == len(finals) == 2048
    mismatched = sum(t.final_length != f for t, f in zip(trajs, finals))
    assert mismatched <= 7  # the format page: all but 7 of 10,287 records agree


def test_read_lengths(tmp_path):
    p = tmp_path / "l.txt"
    p.write_text("# prompt,final\n10,20\n5, 5\n")
    assert read_lengths(p) == [(10, 20), (5, 5)]
    p.write_text("10,3\n")
    with pytest.raises(TraceError, match=":1: final_length 3"):
        read_lengths(p)
