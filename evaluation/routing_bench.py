"""Per-decision latency of C-MLFQ (tree lookup + policy), C++ and Python tree cores.

    python evaluation/routing_bench.py [--data DIR] [--decisions N] [--cmlfq key=value,...] [--json]

Builds the tree from every PolyTrace Search-R1 step (steps 0-5), then times C-MLFQ decisions at the
real decision points of those trajectories (in auto mode, the default, with the switches it chose when the
tree was built; printed after the table):
- decision: CMLFQPolicy.tool_return(req, current) end to end from Python, each call timed alone, median
  and P90. With the C++ core that is one call into C++ per decision (TreeCore.decide_request: the request's
  fields, tool-return state ids from the core's cache, the drift level and growth factor from the state
  installed at the step boundary, lookup, bucket rule); with the Python core the same steps in Python;
- lookup: PrefixTree.lookup_ids alone (Python -> core call), each call timed alone;
- core: the C++ core's own time per lookup, measured inside C++ over the whole query list (no Python).
The 1-minute load average before and after the run is printed with the figures (the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from areal_libra.cmlfq import CMLFQPolicy, RequestInfo, cpp_available, tool_state
from areal_libra.cmlfq.replay import decision_points
from areal_libra.trace import TraceError, read_traces
from evaluation.routing import UsageError, parse_variant

BUCKETS = [1536, 3072, 7168]


def decision_requests(trajs, limit: int) -> list[RequestInfo]:
    out = [r for t in trajs for r in decision_points(t)[1:]]  # tool returns only
    step = max(1, len(out) // limit)
    return out[::step][:limit]


def _quantiles(ns: list[int]) -> tuple[float, float]:
    ns = sorted(ns)
    return ns[len(ns) // 2] / 1000.0, ns[int(0.9 * (len(ns) - 1))] / 1000.0


def bench(backend: str, trajs, reqs: list[RequestInfo], repeat: int = 3, switches: dict | None = None) -> dict:
    pol = CMLFQPolicy(BUCKETS, backend=backend, **(switches or {}))
    pol.fit(trajs)
    clock = time.perf_counter_ns
    dec: list[int] = []
    for _ in range(repeat):
        for r in reqs:
            t0 = clock()
            pol.tool_return(r, 0)
            dec.append(clock() - t0)
    tree = pol.tree
    cfg = pol.config
    q = 0.5 if cfg.center is None else cfg.center
    prepared = [(r.prompt_id, tree.state_ids([tool_state(x, pol.sizes) for x in r.tool_returns]),
                 [r.context_tokens - c for c in r.decision_contexts]) for r in reqs]
    look: list[int] = []
    for _ in range(repeat):
        for pid, ids, floors in prepared:
            t0 = clock()
            tree.lookup_ids(pid, ids, q, floors, cfg.prompt_first)
            look.append(clock() - t0)
    out = {"backend": backend, "nodes": tree.node_count(), "decisions_timed": len(dec)}
    if pol.auto_choice is not None:  # what auto mode chose when the tree was built (then timed with it)
        out["auto"] = pol.auto_choice.as_dict()
    out["decision_median_us"], out["decision_p90_us"] = _quantiles(dec)
    out["lookup_median_us"], out["lookup_p90_us"] = _quantiles(look)
    if backend == "cpp":
        core = tree._core.time_lookups([p for p, _, _ in prepared], [i for _, i, _ in prepared],
                                       [f for _, _, f in prepared], q, cfg.prompt_first, 7)
        out["core_lookup_us"] = core / 1000.0
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="C-MLFQ per-decision latency, C++ vs Python tree core")
    ap.add_argument("--data", default="/work/shared/data/polytrace/search_r1", help="folder with step_*.jsonl.gz")
    ap.add_argument("--decisions", type=int, default=5000, help="decision points to time per pass")
    ap.add_argument("--cmlfq", default="", help="C-MLFQ switches to time, key=value,... (default: the defaults)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    files = sorted(Path(args.data).glob("step_*.jsonl.gz"))
    try:
        switches = parse_variant(f"cmlfq:{args.cmlfq}")[1]
        if not files:
            raise TraceError(f"{args.data}: no step_*.jsonl.gz files")
        if args.decisions < 1:
            raise TraceError("--decisions must be >= 1")
        trajs = read_traces(files)
    except (TraceError, UsageError) as e:
        print(f"routing_bench: {e}", file=sys.stderr)
        return 2
    reqs = decision_requests(trajs, args.decisions)
    load = [os.getloadavg()[0]]
    rows = [bench(b, trajs, reqs, switches=switches) for b in (["cpp"] if cpp_available() else []) + ["python"]]
    load.append(os.getloadavg()[0])
    if args.json:
        print(json.dumps({"trajectories": len(trajs), "load_avg_1m": load, "rows": rows}))
        return 0
    print(f"tree from {len(trajs)} trajectories ({len(files)} files); {len(reqs)} decision points x 3 passes; "
          f"load average (1 min) {load[0]:.2f} -> {load[1]:.2f}")
    print(f"{'backend':<8}{'nodes':>8}{'decision med/p90 (us)':>24}{'lookup med/p90 (us)':>22}{'core (us)':>11}")
    for r in rows:
        core = f"{r['core_lookup_us']:.3f}" if "core_lookup_us" in r else "-"
        print(f"{r['backend']:<8}{r['nodes']:>8}{r['decision_median_us']:>13.2f} / {r['decision_p90_us']:<8.2f}"
              f"{r['lookup_median_us']:>11.2f} / {r['lookup_p90_us']:<8.2f}{core:>11}")
    for r in rows:
        if "auto" in r:
            sw = ",".join(f"{k}={v}" for k, v in r["auto"]["switches"].items())
            print(f"{r['backend']}: auto chose {sw},mlfq_at={r['auto']['mlfq_at'] or '-'}")
    if not cpp_available():
        print("C++ core not built: only the Python fallback was timed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
