"""Synthetic (prompt, final) length histories with a long tail, for the planner's tests."""

from __future__ import annotations

import random


def tail_history(seed: int, n: int, prompt: tuple[int, int], short: tuple[int, int], long: tuple[int, int],
                 p_long: float) -> list[tuple[int, int]]:
    """n rows: a uniform prompt, then an output drawn from `long` with probability p_long, else from `short`."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = rng.randint(*prompt)
        o = rng.randint(*long) if rng.random() < p_long else rng.randint(*short)
        out.append((p, p + o))
    return out
