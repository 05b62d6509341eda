"""Where the calibrated Cost Evaluator's ranking of AReaL-Static-Optimal's candidates goes wrong.

    python -m evaluation.rank_errors RUN.json [--system libra] [--loop areal|libra] [--json]

RUN.json is an `evaluation.throughput --json` output. For each sweep candidate (rollout GPUs x TP, its training
layout) it sets the controller's last prediction (`ranking.last_predicted_step_s`, the calibrated evaluator's step
time) against the candidate's measured tokens/s (--loop areal, the default: as AReaL's loop ran them in
AReaL-Static-Optimal's sweep; --loop libra: as Libra's loop ran them in static_libra_loop's). The candidates replay the same stationary workload, so their
tokens per step are one constant: predicted step x measured tokens/s is proportional to predicted / measured. The
table prints it over its median (1.0: as the median candidate; above: predicted too slow; below: too fast).

Below it, the Spearman of the last prediction against the measurement, and what it would be if one kind of error
were removed by an oracle that knows the measurements (an upper bound on what a calibration could win, never
used by the planner): each TP's error, as its median over the candidates where training has the most GPUs (the
upper half: there rollout binds), or each training size's error (its row's median).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from areal_libra.control.prediction import spearman
from areal_libra.sim.libra import RANKING_PROBES


def relative_errors(run: dict, system: str = "libra", loop: str = "areal") -> list[dict]:
    """One row per candidate: rollout_gpus, tp, train_gpus, measured tokens/s, predicted step s, rel."""
    probe_key, cand_key, _ = RANKING_PROBES[loop]
    cands = run.get(cand_key) or []
    sys_ = run.get("systems", {}).get(system)
    if sys_ is None:
        raise ValueError(f"no system {system!r} in the run (has {sorted(run.get('systems', {}))})")
    pred = (sys_.get(probe_key) or {}).get("last_predicted_step_s")
    if not cands or not pred or len(pred) != len(cands):
        raise ValueError(f"{system}: no ranking of the candidates as {loop}'s loop runs them in the run (its "
                         f"sweep must be cached before {system} runs)")
    rows = [{"rollout_gpus": c["rollout_gpus"], "tp": c["tp"], "train_gpus": c["train"]["gpus"],
             "tokens_per_s": c["tokens_per_s"], "predicted_step_s": p}
            for c, p in zip(cands, pred)]
    x = [r["predicted_step_s"] * r["tokens_per_s"] if r["predicted_step_s"] and r["tokens_per_s"] else None
         for r in rows]
    mid = statistics.median(v for v in x if v is not None)
    for r, v in zip(rows, x):
        r["rel"] = None if v is None else round(v / mid, 3)
    return rows


def oracle_spearman(rows: list[dict]) -> dict[str, float | None]:
    """Spearman of predicted against measured throughput: as predicted, with each TP's error divided out, and
    with each training size's error divided out (see the module's doc)."""
    rows = [r for r in rows if r["rel"] is not None]
    meas = [r["tokens_per_s"] for r in rows]

    def sp(div) -> float | None:
        v = spearman([-r["predicted_step_s"] / div(r) for r in rows], meas)
        return None if v is None else round(v, 4)

    many = statistics.median(r["train_gpus"] for r in rows)
    by_tp = {t: statistics.median([r["rel"] for r in rows if r["tp"] == t and r["train_gpus"] >= many] or [1.0])
             for t in {r["tp"] for r in rows}}
    by_train = {g: statistics.median(r["rel"] for r in rows if r["train_gpus"] == g)
                for g in {r["train_gpus"] for r in rows}}
    return {"as_predicted": sp(lambda r: 1.0),
            "tp_error_removed": sp(lambda r: by_tp[r["tp"]] if r["train_gpus"] >= many else 1.0),
            "train_size_error_removed": sp(lambda r: by_train[r["train_gpus"]])}


def table(rows: list[dict]) -> str:
    tps = sorted({r["tp"] for r in rows})
    out = ["rollout GPUs | train GPUs | " + " | ".join(f"TP{t}" for t in tps)]
    for g in sorted({r["rollout_gpus"] for r in rows}):
        cell = {r["tp"]: r for r in rows if r["rollout_gpus"] == g}
        train = next(iter(cell.values()))["train_gpus"]
        out.append(f"{g:>12} | {train:>10} | " + " | ".join(
            f"{cell[t]['rel']:.2f}" if t in cell and cell[t]["rel"] is not None else "  - " for t in tps))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="an evaluation.throughput --json output")
    ap.add_argument("--system", default="libra")
    ap.add_argument("--loop", default="areal", choices=sorted(RANKING_PROBES),
                    help="hold the prediction against the candidates as this loop ran them")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    try:
        rows = relative_errors(json.loads(a.run.read_text()), a.system, a.loop)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"rank_errors: {a.run}: {e}", file=sys.stderr)
        return 2
    what_if = oracle_spearman(rows)
    if a.json:
        print(json.dumps({"candidates": rows, "spearman": what_if}, indent=1))
    else:
        print(table(rows))
        print("spearman: " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in what_if.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
