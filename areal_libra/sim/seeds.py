"""Comparisons over seeds: a system against the one listed before it (a ladder's rung against the rung below),
paired by seed. Every system of one seed runs on the same random draws (common random numbers), so the
per-seed change is the comparison, and its spread over seeds is what one seed's figure cannot show."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from statistics import NormalDist, mean, stdev


def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t with `df` degrees of freedom (a two-sided 95% interval). Closed forms
    at df 1 and 2; from df 3 on the Cornish-Fisher expansion to the fourth order (Abramowitz & Stegun 26.7.5),
    within 0.2% of the exact value."""
    if df < 1:
        raise ValueError(f"a t quantile needs df >= 1, got {df}")
    p = 0.975
    if df == 1:
        return math.tan(math.pi * (p - 0.5))
    if df == 2:
        return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    z = NormalDist().inv_cdf(p)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / df + g2 / df**2 + g3 / df**3 + g4 / df**4


def paired_changes(runs: Mapping[int, Mapping[str, float]], order: Sequence[str],
                   floor_pct: float = -1.0) -> dict[str, dict]:
    """For each system after the first in `order`: its change against the system before it at every seed
    (percent of tokens/s), their mean, standard deviation and 95% t-interval of the mean (None with one
    seed), and the seeds where it falls below `floor_pct` (the ladder's "no rung more than 1% below")."""
    out: dict[str, dict] = {}
    seeds = sorted(runs)
    for prev, cur in zip(order, order[1:]):
        per = {s: 100.0 * (runs[s][cur] / runs[s][prev] - 1.0) for s in seeds if runs[s][prev] > 0}
        vals = list(per.values())
        m = mean(vals) if vals else None
        sd = stdev(vals) if len(vals) > 1 else None
        half = None if sd is None else t_quantile_975(len(vals) - 1) * sd / math.sqrt(len(vals))
        out[cur] = {"against": prev, "per_seed_pct": {str(s): v for s, v in per.items()}, "mean_pct": m,
                    "sd_pct": sd, "ci95_pct": None if half is None else [m - half, m + half],
                    "seeds_below_floor": [s for s, v in per.items() if v < floor_pct], "floor_pct": floor_pct}
    return out
