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
