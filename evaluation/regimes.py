"""Regime map of Libra vs AReaL-Static-Optimal on the simulated cluster (areal_libra/sim/regimes.py).

python -m evaluation.regimes [--steps 20] [--jobs 2] [--json] [--png evaluation/figures/regimes.png] [--axes tail,drift]
Progress goes to stderr; --json prints every point's figures on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

from areal_libra.sim.cluster import SimError
from areal_libra.sim.hardware import TRUTH_PROFILES
from areal_libra.sim.regimes import AXES, Point, heatmap, sweep
from areal_libra.trace import TraceError
from areal_libra.utils import first_line


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20,
                    help="training steps per 48-GPU point (drift spans them; larger clusters run fewer, >= 4)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2, help="points simulated in parallel processes")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--png", default="evaluation/figures/regimes.png", help="heat-map PNG ('' for none)")
    ap.add_argument("--axes", default=",".join(AXES), help=f"comma-separated subset of: {','.join(AXES)}")
    ap.add_argument("--truth", default="default", choices=sorted(TRUTH_PROFILES),
                    help="hardware truth profile (areal_libra/sim/hardware.py TRUTH_PROFILES; docs/simulator.md)")
    args = ap.parse_args(argv)
    try:
        names = [a for a in args.axes.split(",") if a]
        bad = [a for a in names if a not in AXES]
        if bad:
            raise ValueError(f"unknown axis {bad[0]!r}; choose from {', '.join(AXES)}")
        if args.steps < 3:
            raise ValueError("--steps must be >= 3")
        axes = {a: AXES[a] for a in names}
        base = Point()
        t0 = time.time()
        results = sweep(base, args.steps, args.seed, axes, log=lambda m: print(m, file=sys.stderr, flush=True),
                        jobs=args.jobs, truth=args.truth)
        wall = time.time() - t0
        if args.png:
            heatmap(args.png, results, base, axes)
    except (ValueError, SimError, TraceError, OSError) as e:
        print(f"error: {first_line(e)}", file=sys.stderr)
        return 2
    leads = [r for r in results if r["libra_over_static"] >= 1.2]
    if args.json:
        print(json.dumps({"base": replace(base).__dict__, "steps": args.steps, "seed": args.seed, "truth": args.truth,
                          "wall_s": round(wall, 1), "points": results,
                          "leads_20pct": [{"axis": r["axis"], "value": r["value"]} for r in leads]}, indent=1))
    else:
        print(f"{'axis':8s} {'value':>10s} {'libra/static':>12s} {'libra/roof':>10s} {'static/roof':>11s} "
              f"{'tool share':>10s} {'static t/s':>10s} {'libra t/s':>10s} {'static paper':>12s} {'libra paper':>11s}")
        for r in results:
            s_, lb = r["areal_static_optimal"], r["libra"]
            print(f"{r['axis']:8s} {str(r['value']):>10s} {r['libra_over_static']:12.2f} "
                  f"{r['libra_over_roofline']:10.2f} {r['static_over_roofline']:11.2f} {r['tool_time_share']:10.2f} "
                  f"{s_['tokens_per_s']:10.0f} {lb['tokens_per_s']:10.0f} {s_['paper_tokens_per_s']:12.0f} "
                  f"{lb['paper_tokens_per_s']:11.0f}")
        print("t/s: model-generated tokens per second; paper: the Libra paper's unit (input + output tokens of "
              "the trained trajectories per second, whole cluster)")
        print(f"{len(results)} points, {args.steps} steps each, {wall:.0f} s; Libra >= 1.2x static at: "
              + (", ".join(f"{r['axis']}={r['value']}" for r in leads) or "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
