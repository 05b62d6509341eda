"""Sim-to-live decision agreement: Libra's first plan, re-plans and elastic moves in the simulator next to the
live run's, step by step.

    python -m evaluation.decisions SIM_EVENTS LIVE_EVENTS [--tolerance 2] [--json]

Both logs are in the live run's format (control_events.jsonl: one {"step", "event", "detail"} a line), and both
are written from the one LibraController's events (areal_libra.control): the live run's LiveControl writes its
control_events.jsonl; `sim_events` writes the simulator's from the same controller's `events` (the simulator's
first plan, solved before step 1 from its profiling pass, is the "initial_plan" line at step 0).
`evaluation.live_ab --workload ...` runs both and puts the comparison in its JSON ("decisions").

They agree when the first plans put the same layout on the cluster (rollout servers and training layout), and
the moves (replan, join, release) match one for one in order: the same kind, a re-plan to the same layout, at
steps at most `tolerance` apart. "kept" decisions (a re-plan the gate refused) are listed, not compared.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from areal_libra.utils import atomic_write_text

MOVES = ("replan", "join", "release")
TOLERANCE = 2  # steps (issue 24: "at the same steps within 2 steps")
_ROLLOUT = re.compile(r"\b(?:sglang|embedded):(\S+?)[;,]?(?:\s|$)")
_TRAIN = re.compile(r"\b(?:megatron|fsdp):(d\d+t\d+(?:p\d+)?)")


def plan_event(step: int, plan: Any) -> dict[str, Any]:
    """The "initial_plan" line of a plan (areal_libra.planner.Plan), as the live run writes it, with its layout."""
    return {"step": int(step), "event": "initial_plan", "detail": plan.summary(),
            "rollout": _alloc(plan.rollout_alloc()), "train": _alloc(plan.train_alloc())}


def controller_events(ctl: Any) -> list[dict[str, Any]]:
    """A LibraController's decisions (ControlEvent) as control_events.jsonl lines."""
    return [{"step": int(e.step), "event": str(e.kind), "detail": str(e.detail)} for e in ctl.events]


def run_sim_libra(env: Any, steps: int) -> tuple[dict, list[dict[str, Any]]]:
    """The simulator's Libra on `env` for `steps` (sim.registry.run_system), and its decision log: the first
    plan at step 0, then the controller's events."""
    from areal_libra.sim.registry import build_system, run_system

    spec = build_system("libra", env)
    first = plan_event(0, spec.controller.ctl.plan)  # before the run: a re-plan replaces ctl.plan
    res, sim = run_system("libra", env, steps, spec=spec)
    return res, [first, *controller_events(sim.controller.ctl)]


def write_events(path: Path, events: list[dict[str, Any]]) -> Path:
    atomic_write_text(path, "".join(json.dumps(e) + "\n" for e in events))
    return path


def read_events(path: Path) -> list[dict[str, Any]]:
    """control_events.jsonl; ValueError (one line) when it is missing or malformed."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror or e}") from None
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            e = json.loads(line)
            out.append({**e, "step": int(e["step"]), "event": str(e["event"]), "detail": str(e.get("detail", ""))})
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{path}:{i}: not a control event line") from None
    return out


def _alloc(s: str) -> str:
    """An allocation without its backend: sglang:d1t1+d2t4 -> d1t1+d2t4 (the emulated servers are embedded:...)."""
    return s.split(":", 1)[1] if ":" in s else s


def layout(e: dict[str, Any]) -> tuple[str | None, str | None]:
    """(rollout allocation, training layout) a first-plan or re-plan line names (None where it names none)."""
    if "rollout" in e or "train" in e:
        return e.get("rollout"), e.get("train")
    d = e.get("detail", "")
    r, t = _ROLLOUT.search(d), _TRAIN.search(d)
    return (r.group(1) if r else None), (t.group(1) if t else None)


def compare(sim: list[dict[str, Any]], live: list[dict[str, Any]], tolerance: int = TOLERANCE) -> dict[str, Any]:
    """Side by side: the first plans, then the moves paired in order; `agree` as in the module doc."""
    def first(evs: list[dict[str, Any]]) -> dict[str, Any] | None:
        return next((e for e in evs if e["event"] == "initial_plan"), None)

    fs, fl = first(sim), first(live)
    first_same = fs is not None and fl is not None and layout(fs) == layout(fl)
    plan = {"sim": None if fs is None else {"step": fs["step"], "layout": list(layout(fs))},
            "live": None if fl is None else {"step": fl["step"], "layout": list(layout(fl))},
            "same": first_same, "steps_within": fs is not None and fl is not None
            and abs(fs["step"] - fl["step"]) <= tolerance}
    ms = [e for e in sim if e["event"] in MOVES]
    ml = [e for e in live if e["event"] in MOVES]
    rows = []
    for i in range(max(len(ms), len(ml))):
        a = ms[i] if i < len(ms) else None
        b = ml[i] if i < len(ml) else None
        ok = a is not None and b is not None and a["event"] == b["event"] and abs(a["step"] - b["step"]) <= tolerance
        if ok and a["event"] == "replan":
            ok = layout(a) == layout(b)
        rows.append({"sim": None if a is None else _row(a), "live": None if b is None else _row(b), "agree": ok})
    kept = {"sim": [e["step"] for e in sim if e["event"] == "kept"],
            "live": [e["step"] for e in live if e["event"] == "kept"]}
    return {"first_plan": plan, "moves": rows, "kept": kept, "tolerance": tolerance,
            "agree": bool(first_same and plan["steps_within"] and all(r["agree"] for r in rows))}


def _row(e: dict[str, Any]) -> dict[str, Any]:
    out = {"step": e["step"], "event": e["event"]}
    if e["event"] == "replan":
        out["layout"] = list(layout(e))
    else:
        out["detail"] = e["detail"]
    return out


def table(cmp: dict[str, Any]) -> str:
    """The comparison as text: one line per decision, simulator | live | agreement."""
    def cell(x: dict[str, Any] | None) -> str:
        if x is None:
            return "-"
        what = " train ".join(str(v) for v in x["layout"]) if "layout" in x else x.get("detail", "")
        return f"step {x['step']}: {x.get('event', 'first plan')} {what}"[:60]

    fp = cmp["first_plan"]
    lines = [f"{'simulator':60s} | {'live':60s} | agree",
             f"{cell(fp['sim']):60s} | {cell(fp['live']):60s} | {'yes' if fp['same'] else 'NO'}"]
    for r in cmp["moves"]:
        lines.append(f"{cell(r['sim']):60s} | {cell(r['live']):60s} | {'yes' if r['agree'] else 'NO'}")
    lines.append(f"kept (gate refused): simulator at {cmp['kept']['sim']}, live at {cmp['kept']['live']}")
    lines.append(f"decisions agree within {cmp['tolerance']} steps: {'yes' if cmp['agree'] else 'NO'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evaluation.decisions", description=__doc__.splitlines()[0])
    ap.add_argument("sim_events", help="the simulator's event log (control_events.jsonl format)")
    ap.add_argument("live_events", help="the live run's control_events.jsonl")
    ap.add_argument("--tolerance", type=int, default=TOLERANCE, help="steps two matching decisions may be apart")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.tolerance < 0:
        print("error: --tolerance must be >= 0", file=sys.stderr)
        return 2
    try:
        cmp = compare(read_events(Path(args.sim_events)), read_events(Path(args.live_events)), args.tolerance)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(cmp) if args.json else table(cmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
