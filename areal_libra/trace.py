"""Canonical trajectory traces (docs/trace-format.md): read, write, derive.

Reads canonical `.jsonl[.gz]` files and PolyTrace Search-R1 records (detected by `turns`/`tool_calls`).
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

TOOL_STATUSES = ("success", "failure", "timeout")
FINISH_REASONS = ("stop", "length", "abort")


class TraceError(ValueError):
    """A malformed trace record; the message names file, line and field."""


@dataclass(frozen=True)
class ToolReturn:
    name: str
    payload_tokens: int
    status: str = "success"
    latency_s: float = 0.0


@dataclass(frozen=True)
class Segment:
    gen_tokens: int
    tool: ToolReturn | None = None


@dataclass
class Trajectory:
    trajectory_id: str
    prompt_id: str
    step: int
    prompt_tokens: int
    segments: tuple[Segment, ...]
    finish_reason: str | None = None
    reward: float | None = None
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def model_tokens(self) -> int:
        return sum(s.gen_tokens for s in self.segments)

    @property
    def final_length(self) -> int:
        return self.context_after(len(self.segments) - 1)

    def context_after(self, k: int) -> int:
        """Context length after segment k (its generation and its tool return)."""
        total = self.prompt_tokens
        for s in self.segments[: k + 1]:
            total += s.gen_tokens + (s.tool.payload_tokens if s.tool else 0)
        return total

    def tool_returns(self) -> list[ToolReturn]:
        return [s.tool for s in self.segments if s.tool is not None]

    def remaining_model_tokens(self, k: int) -> int:
        """Model tokens generated after decision point k (0 = start, k = after the k-th tool return)."""
        return sum(s.gen_tokens for s in self.segments[k:])

    def to_json(self) -> dict:
        d = {
            "trajectory_id": self.trajectory_id,
            "prompt_id": self.prompt_id,
            "step": self.step,
            "prompt_tokens": self.prompt_tokens,
            "segments": [
                {
                    "gen_tokens": s.gen_tokens,
                    "tool": None
                    if s.tool is None
                    else {
                        "name": s.tool.name,
                        "payload_tokens": s.tool.payload_tokens,
                        "status": s.tool.status,
                        "latency_s": s.tool.latency_s,
                    },
                }
                for s in self.segments
            ],
        }
        if self.finish_reason is not None:
            d["finish_reason"] = self.finish_reason
        if self.reward is not None:
            d["reward"] = self.reward
        return d


def _open_text(path: Path):
    if str(path).endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _need(rec: dict, key: str, kind, where: str):
    if key not in rec:
        raise TraceError(f"{where}: missing field '{key}'")
    val = rec[key]
    if kind is int and (isinstance(val, bool) or not isinstance(val, int)):
        raise TraceError(f"{where}: field '{key}' must be an integer, got {val!r}")
    if kind is float and (isinstance(val, bool) or not isinstance(val, (int, float))):
        raise TraceError(f"{where}: field '{key}' must be a number, got {val!r}")
    if kind is str and not isinstance(val, (str, int)):
        raise TraceError(f"{where}: field '{key}' must be a string, got {val!r}")
    if kind is list and not isinstance(val, list):
        raise TraceError(f"{where}: field '{key}' must be a list, got {type(val).__name__}")
    if kind in (int, float) and val < 0:
        raise TraceError(f"{where}: field '{key}' must be >= 0, got {val!r}")
    return val


def parse_canonical(rec: dict, where: str) -> Trajectory:
    segs_raw = _need(rec, "segments", list, where)
    if not segs_raw:
        raise TraceError(f"{where}: field 'segments' must hold at least one segment")
    segments = []
    for i, s in enumerate(segs_raw):
        sw = f"{where}: segments[{i}]"
        if not isinstance(s, dict):
            raise TraceError(f"{sw}: must be an object")
        gen = _need(s, "gen_tokens", int, sw)
        tool = s.get("tool")
        if tool is None:
            segments.append(Segment(gen, None))
            continue
        if not isinstance(tool, dict):
            raise TraceError(f"{sw}: field 'tool' must be an object or null")
        tw = f"{sw}.tool"
        status = tool.get("status", "success")
        if status not in TOOL_STATUSES:
            raise TraceError(f"{tw}: field 'status' must be one of {TOOL_STATUSES}, got {status!r}")
        lat = float(_need(tool, "latency_s", float, tw)) if "latency_s" in tool else 0.0
        segments.append(
            Segment(gen, ToolReturn(str(_need(tool, "name", str, tw)), _need(tool, "payload_tokens", int, tw), status, lat))
        )
    fr = rec.get("finish_reason")
    if fr is not None and fr not in FINISH_REASONS:
        raise TraceError(f"{where}: field 'finish_reason' must be one of {FINISH_REASONS}, got {fr!r}")
    reward = rec.get("reward")
    if reward is not None:
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise TraceError(f"{where}: field 'reward' must be a number, got {reward!r}")
        reward = float(reward)
    return Trajectory(
        trajectory_id=str(_need(rec, "trajectory_id", str, where)),
        prompt_id=str(_need(rec, "prompt_id", str, where)),
        step=_need(rec, "step", int, where),
        prompt_tokens=_need(rec, "prompt_tokens", int, where),
        segments=tuple(segments),
        finish_reason=fr,
        reward=reward,
    )


def parse_polytrace(rec: dict, where: str) -> Trajectory:
    step = _need(rec, "step", int, where)
    turns = _need(rec, "turns", list, where)
    if not turns:
        raise TraceError(f"{where}: field 'turns' must hold at least one turn")
    calls_raw = rec.get("tool_calls") or []
    if not isinstance(calls_raw, list):
        raise TraceError(f"{where}: field 'tool_calls' must be a list, got {type(calls_raw).__name__}")
    calls_by_turn: dict[int, list[dict]] = {}
    for j, c in enumerate(calls_raw):
        cw = f"{where}: tool_calls[{j}]"
        if not isinstance(c, dict):
            raise TraceError(f"{cw}: must be an object")
        _need(c, "append_len", int, cw)
        if "latency_s" in c and c["latency_s"] is not None:
            _need(c, "latency_s", float, cw)
        calls_by_turn.setdefault(_need(c, "turn", int, cw), []).append(c)
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            raise TraceError(f"{where}: turns[{i}]: must be an object")
        if "turn" in t:
            _need(t, "turn", int, f"{where}: turns[{i}]")
    segments = []
    for i, t in enumerate(sorted(turns, key=lambda t: t.get("turn", 0))):
        gen = _need(t, "assistant_append_len", int, f"{where}: turns[{i}]")
        calls = calls_by_turn.get(t.get("turn", i), [])
        tool = None
        if calls:
            # Several calls in one turn form one tool return; any non-success makes it a failure.
            status = "success" if all(c.get("status") == "success" for c in calls) else "failure"
            tool = ToolReturn(
                name=str(calls[0].get("tool_name", "tool")),
                payload_tokens=sum(c["append_len"] for c in calls),
                status=status,
                latency_s=float(sum(float(c.get("latency_s") or 0.0) for c in calls)),
            )
        segments.append(Segment(gen, tool))
    group = _need(rec, "prompt_group_id", int, where)
    sample = _need(rec, "sample_id", int, where)
    fr = rec.get("finish_reason")
    return Trajectory(
        trajectory_id=f"s{step}-p{group}-{sample}",
        prompt_id=f"s{step}-p{group}",
        step=step,
        prompt_tokens=_need(rec, "prompt_len", int, where),
        segments=tuple(segments),
        finish_reason=fr if fr in FINISH_REASONS else None,
        reward=rec.get("reward") if isinstance(rec.get("reward"), (int, float)) else None,
    )


def parse_record(rec: object, where: str) -> Trajectory:
    if not isinstance(rec, dict):
        raise TraceError(f"{where}: record must be a JSON object")
    if "turns" in rec or "tool_calls" in rec:
        return parse_polytrace(rec, where)
    return parse_canonical(rec, where)


def iter_trace(path: str | os.PathLike, skip_bad: bool = False, stats: dict | None = None) -> Iterator[Trajectory]:
    """Yield trajectories from one file. Raises TraceError on the first bad record unless skip_bad;
    skipped lines are counted in stats['bad_lines']."""
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"{p}: no such trace file")
    try:
        with _open_text(p) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{p}:{lineno}"
                try:
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise TraceError(f"{where}: not valid JSON ({e.msg})") from None
                    yield parse_record(rec, where)
                except TraceError:
                    if not skip_bad:
                        raise
                    if stats is not None:
                        stats["bad_lines"] = stats.get("bad_lines", 0) + 1
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise TraceError(f"{p}: cannot read trace ({e})") from None


def read_traces(paths: str | os.PathLike | Sequence[str | os.PathLike], skip_bad: bool = False,
                stats: dict | None = None) -> list[Trajectory]:
    """Read one or several trace files (canonical or PolyTrace, optionally gzipped)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[Trajectory] = []
    for p in paths:
        out.extend(iter_trace(p, skip_bad=skip_bad, stats=stats))
    return out


def write_traces(path: str | os.PathLike, trajectories: Iterable[Trajectory]) -> None:
    """Write a canonical trace atomically (temp file in the same folder, then rename)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    os.close(fd)
    try:
        opener = gzip.open(tmp, "wt", encoding="utf-8") if p.name.endswith(".gz") else open(tmp, "w", encoding="utf-8")
        with opener as f:
            for t in trajectories:
                f.write(json.dumps(t.to_json(), separators=(",", ":")) + "\n")
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_lengths(path: str | os.PathLike) -> list[tuple[int, int]]:
    """Read `prompt_tokens,final_length` pairs, one per line ('#' comments allowed)."""
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"{p}: no such lengths file")
    out = []
    with open(p, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = [x.strip() for x in line.split(",")]
            if len(parts) != 2 or not all(x.isdigit() for x in parts):
                raise TraceError(f"{p}:{lineno}: expected 'prompt_tokens,final_length' as two non-negative integers")
            a, b = int(parts[0]), int(parts[1])
            if b < a:
                raise TraceError(f"{p}:{lineno}: final_length {b} is smaller than prompt_tokens {a}")
            out.append((a, b))
    return out
