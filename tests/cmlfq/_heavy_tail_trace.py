"""A trace family written for the C-MLFQ auto-mode robustness test (tests/test_cmlfq_auto.py), on purpose
unlike evaluation/synth_trace.py and not tuned to any policy: no prompt ever recurs (every trajectory has
its own prompt id), turns are memoryless (the agent stops after each turn with probability 0.35, at most
30 turns), and lengths are heavy-tailed (Pareto generation lengths, alpha 1.3; Pareto payloads, alpha
1.2; 10% failed calls with short error payloads)."""

from __future__ import annotations

import math
import random

from areal_libra.trace import Segment, ToolReturn, Trajectory

BUCKETS = [2048, 8192, 32768]


def heavy_tail_trace(steps: int = 6, per_step: int = 250, seed: int = 0) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for s in range(steps):
        for i in range(per_step):
            prompt = int(rng.lognormvariate(math.log(400), 0.6)) + 1
            segs = []
            while True:
                gen = int(min(20_000, 80 * rng.paretovariate(1.3)))
                if len(segs) >= 29 or rng.random() < 0.35:
                    segs.append(Segment(gen))
                    break
                tool = rng.choice(("web", "code"))
                ok = rng.random() >= 0.1
                payload = int(min(30_000, 150 * rng.paretovariate(1.2))) if ok else 40
                segs.append(Segment(gen, ToolReturn(tool, payload, "success" if ok else "failure")))
            out.append(Trajectory(f"h{seed}-s{s}-t{i}", f"h{seed}-s{s}-p{i}", s, prompt, tuple(segs)))
    return out


def main(argv: list[str] | None = None) -> int:
    """python -m tests.cmlfq._heavy_tail_trace --out DIR [--seed S] [--steps N] [--per-step M]: write
    DIR/step_{i}.jsonl.gz (for evaluation/routing.py; README section "cmlfq")."""
    import argparse
    import sys
    from pathlib import Path

    from areal_libra.trace import write_traces

    ap = argparse.ArgumentParser(description="heavy-tailed, non-recurring agentic trace (C-MLFQ auto test)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--per-step", type=int, default=250)
    args = ap.parse_args(argv)
    if args.steps < 1 or args.per_step < 1:
        print("heavy_tail_trace: --steps and --per-step must be >= 1", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trajs = heavy_tail_trace(args.steps, args.per_step, args.seed)
    for s in range(args.steps):
        write_traces(out / f"step_{s}.jsonl.gz", [t for t in trajs if t.step == s])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
