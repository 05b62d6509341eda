"""Planner solve-time benchmark: python evaluation/planner_bench.py [--repeat 3] [--json] [--python-only]

Solves Qwen3-14B on A800 clusters of 48, 256 and 1,024 GPUs from a 4,096-request history (the first 4,096
Search-R1 PolyTrace trajectories of steps 0-1), with the default global batch (512 sequences) and with one
sequence per history entry (4,096). Reports the median wall time of `solve` (targets: <= 0.1 s at 48 GPUs,
<= 2 s at 1,024), its CPU time (what it costs on an idle core when the machine is shared) and the plan. --python-only disables the C++ DP probe (same results, slower).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

DATA = Path("/work/shared/data/polytrace/search_r1")
TARGETS = {48: 0.1, 1024: 2.0}


def history(n: int = 4096) -> list[tuple[int, int, int]]:
    from areal_libra.trace import read_traces

    files = [DATA / f"step_{i}.jsonl.gz" for i in range(3)]
    h = [(t.prompt_tokens, t.final_length, t.model_tokens) for t in read_traces([f for f in files if f.exists()])]
    if len(h) < n:
        raise SystemExit(f"error: need {n} trajectories in {DATA}, found {len(h)}")
    return h[:n]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--python-only", action="store_true", help="use the numpy DP probe, not the C++ one")
    args = ap.parse_args(argv)

    from areal_libra.planner import PlannerConfig, rollout_dp, solve

    if args.python_only:
        rollout_dp._native = None
    hist = history()
    rows = []
    for gpus in (48, 256, 1024):
        for gb in (512, 4096):
            cfg = PlannerConfig(global_batch=gb)
            times, cpu, plan = [], [], None
            for _ in range(args.repeat):
                t0, c0 = time.perf_counter(), time.process_time()
                plan = solve(f"a800x{gpus}", "qwen3-14b", hist, cfg)
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
            assert plan is not None
            med = statistics.median(times)
            target = TARGETS.get(gpus)
            rows.append({"gpus": gpus, "history": len(hist), "global_batch": gb, "solve_s": round(med, 4),
                         "cpu_s": round(statistics.median(cpu), 4),
                         "target_s": target, "meets_target": None if target is None else med <= target,
                         "native": rollout_dp._native is not None, "train": plan.train_alloc(),
                         "rollout": plan.rollout_alloc(), "t_train_s": round(plan.t_train_s, 2),
                         "t_rollout_s": round(plan.t_rollout_s, 2)})
    if args.json:
        for r in rows:
            print(json.dumps(r))
    else:
        print(f"{'GPUs':>5} {'batch':>6} {'solve s':>8} {'cpu s':>7} {'target':>7}  plan")
        for r in rows:
            tgt = f"<={r['target_s']}" if r["target_s"] else "-"
            print(f"{r['gpus']:>5} {r['global_batch']:>6} {r['solve_s']:>8.3f} {r['cpu_s']:>7.3f} {tgt:>7}  {r['train']}  "
                  f"{r['rollout']}  T_train {r['t_train_s']} s  T_rollout {r['t_rollout_s']} s")
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        print(f"(median of {args.repeat}; C++ DP probe {'on' if rows[0]['native'] else 'off'}; {os.cpu_count()} CPUs, "
              f"load average {load:.1f}; cpu s = process CPU time, solve s = wall time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
