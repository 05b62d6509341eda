"""How well Libra's controller predicts (issue 23): each decision's predicted step against the steps it
then measured (`prediction_summary`), the step an elastic move predicts (`projected_step_s`, on the pool's
projection elastic.policy.scaled_terms), and whether
the calibrated Cost Evaluator ranks layouts it did not choose as they run (`RankingProbe`).

A sweep (in the simulator: AReaL-Static-Optimal's, `baseline_candidates`) gives layouts with their measured
throughput. From a given step on, the controller prices every one of them as a plan with the evaluator it
decides with: the same `price_terms` the gate uses, the calibration factors in force at that step and the
controller's history at that step (never a simulator's truth: the plans are layouts, the measured throughput
is only held against the ranking afterwards). The Spearman rank correlation between the predicted and the
measured throughput says whether the evaluator would have picked the right layout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from areal_libra.control.calibration import Factors
from areal_libra.cost.training import TrainParallel
from areal_libra.elastic.policy import scaled_terms
from areal_libra.planner.types import Plan, RolloutInstance


def ranks(xs: Sequence[float]) -> list[float]:
    """1-based ranks of `xs` (ascending); tied values share the mean of the ranks they span."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return out


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman's rank correlation (the Pearson correlation of the tie-averaged ranks); None when it is not
    defined (fewer than 2 pairs, or one side constant). ValueError for sequences of different lengths."""
    if len(xs) != len(ys):
        raise ValueError(f"spearman needs equal lengths, got {len(xs)} and {len(ys)}")
    if len(xs) < 2:
        return None
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    if sxx <= 0 or syy <= 0:
        return None
    return sxy / math.sqrt(sxx * syy)


def layout_plan(rollout_gpus: int, tp: int, train: TrainParallel, max_len: int, n_gpus: int = 0) -> Plan:
    """A homogeneous static layout as a Plan the evaluator can price: rollout_gpus / tp servers of TP `tp`
    serving every length up to `max_len` (one routing bucket), and the training layout `train`."""
    if rollout_gpus < tp or rollout_gpus % tp:
        raise ValueError(f"{rollout_gpus} rollout GPUs are not a multiple of TP {tp}")
    inst = RolloutInstance(tp=tp, count=rollout_gpus // tp, max_len=max_len)
    return Plan(train=train, rollout_gpus=rollout_gpus, instances=[inst], t_train_s=0.0, t_rollout_s=0.0,
                makespan_s=0.0, solve_s=0.0, n_gpus=n_gpus or rollout_gpus + train.gpus)


class RankingProbe:
    """Candidate plans with their measured throughput (tokens/s); `observe` prices them at one step and
    records the Spearman correlation of predicted against measured throughput (`record`, JSON-able)."""

    def __init__(self, plans: Sequence[Any], measured: Sequence[float], from_step: int = 5,
                 labels: Sequence[str] | None = None, loop: dict[str, Any] | None = None) -> None:
        """`loop`: how the loop the candidates were measured under differs from the one the evaluator prices by
        default (planner config fields, e.g. {"admission": "unbounded"} for AReaL's), passed to price_terms."""
        if len(plans) != len(measured):
            raise ValueError(f"{len(plans)} candidate plans but {len(measured)} measurements")
        if labels is not None and len(labels) != len(plans):
            raise ValueError(f"{len(plans)} candidate plans but {len(labels)} labels")
        self.plans, self.measured, self.from_step = list(plans), [float(m) for m in measured], from_step
        self.labels = list(labels) if labels is not None else [str(i) for i in range(len(plans))]
        self.loop = dict(loop or {})
        self.record: dict[str, Any] = {"from_step": from_step, "n_candidates": len(self.plans), "steps": [],
                                       "spearman": [], "min": None, "mean": None}
        if self.loop:
            self.record["loop"] = dict(self.loop)

    def _terms(self, planner: Any, history: Sequence[tuple[int, ...]]) -> list[tuple[float, float] | None]:
        """Each candidate's uncalibrated (T_train, T_rollout); None where the evaluator finds it infeasible
        (e.g. a request longer than a server's KV)."""
        out: list[tuple[float, float] | None] = []
        for p in self.plans:
            try:
                t_train, t_roll, _ = planner.price_terms(p, history, **self.loop)
            except ValueError:
                out.append(None)
                continue
            out.append((t_train, t_roll))
        return out

    @staticmethod
    def _step_s(terms: Sequence[tuple[float, float] | None], factors: Factors) -> list[float]:
        return [math.inf if t is None else factors.step_s(*t) for t in terms]

    def predicted_step_s(self, planner: Any, history: Sequence[tuple[int, ...]], factors: Factors) -> list[float]:
        """Each candidate's step time by the calibrated evaluator (inf where it is infeasible)."""
        return self._step_s(self._terms(planner, history), factors)

    def observe(self, step: int, planner: Any, history: Sequence[tuple[int, ...]], factors: Factors) -> float | None:
        """Price every candidate at `step` and record the rank correlation; None before `from_step`, or when
        it is not defined. The uncalibrated evaluator's correlation is recorded beside it (what calibration
        changed)."""
        if step < self.from_step or not self.plans:
            return None
        terms = self._terms(planner, history)
        pred, raw = self._step_s(terms, factors), self._step_s(terms, Factors())

        def rho_of(step_s: list[float]) -> float | None:
            # Every candidate trains the same batch, so throughput ranks as 1 / step time (inf: throughput 0).
            return spearman([0.0 if not math.isfinite(t) or t <= 0 else 1.0 / t for t in step_s], self.measured)

        rho = rho_of(pred)
        if rho is None:
            return None
        rec = self.record
        rec["steps"].append(step)
        rec["spearman"].append(round(rho, 4))
        rho_raw = rho_of(raw)
        rec.setdefault("spearman_uncalibrated", []).append(None if rho_raw is None else round(rho_raw, 4))
        rec["min"] = min(rec["spearman"])
        rec["mean"] = round(sum(rec["spearman"]) / len(rec["spearman"]), 4)
        best = min(range(len(pred)), key=lambda i: pred[i])
        rec["last_predicted_step_s"] = [round(t, 2) if math.isfinite(t) else None for t in pred]
        rec["last_predicted_best"] = self.labels[best]
        rec["measured_best"] = self.labels[max(range(len(self.measured)), key=lambda i: self.measured[i])]
        return rho


def projected_step_s(t_train_s: float, t_rollout_s: float, interval_s: float, replicas: int, rollout_gpus: int,
                     unit_gpus: int, delta: int) -> float | None:
    """The step an elastic move predicts: the measured times scaled onto the pool after the move
    (elastic.policy.scaled_terms), plus the time neither side explains (the measured interval beyond the longer side).
    None when the move would empty a side."""
    after = scaled_terms(t_train_s, t_rollout_s, replicas, rollout_gpus, unit_gpus, delta)
    if after is None:
        return None
    fixed = max(0.0, interval_s - max(t_train_s, t_rollout_s))
    return max(after) + fixed


def prediction_summary(predictions: Sequence[dict[str, Any]], lo: float = 0.85, hi: float = 1.15,
                       kinds: Sequence[str] = ("replan", "join", "release")) -> dict[str, Any]:
    """The controller's scored predictions (LibraController.predictions: step, kind, predicted_s, measured_s =
    the mean of the next steps, ratio = predicted / measured) as a report: one row per decision, and whether
    every one of `kinds` (the decisions that move resources) and every decision of any kind lies in [lo, hi]."""
    rows = [{"step": int(p["step"]), "kind": str(p["kind"]), "predicted_s": round(float(p["predicted_s"]), 2),
             "measured_next_s": round(float(p["measured_s"]), 2), "ratio": round(float(p["ratio"]), 4)}
            for p in predictions]
    moves = [r for r in rows if r["kind"] in kinds]

    def inside(rs: list[dict[str, Any]]) -> bool:
        return all(lo <= r["ratio"] <= hi for r in rs)

    return {"band": [lo, hi], "decisions": rows, "n": len(rows), "n_moves": len(moves),
            "moves_within": inside(moves), "all_within": inside(rows),
            "outside": [r["step"] for r in rows if not lo <= r["ratio"] <= hi]}
