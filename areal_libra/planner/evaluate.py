"""Price an existing plan on a (new) length history: the T_cur that the re-plan gate compares with T_new.

Training: the plan's layout on the new batch statistics. Rollout: the history sample is routed to the
plan's instance groups by final length (group i takes lengths up to its max_len, the last group takes
everything longer), and each group's cost is the same fluid estimate the planner optimised; under a loop
without working-set admission (PlannerConfig.admission "unbounded", AReaL's) plus the re-prefill of the
contexts its KV cache could not keep.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from areal_libra.cost.presets import ClusterSpec, ModelSpec, load_cluster, load_model
from areal_libra.cost.rollout import RolloutCost
from areal_libra.cost.training import BatchStats, TrainCost
from areal_libra.planner.solve import _validate, sample_history, sustained_fixed_point
from areal_libra.planner.types import Plan, PlannerConfig


@dataclass(frozen=True)
class PlanPrice:
    t_train_s: float
    t_rollout_s: float
    group_s: tuple[float, ...]  # per instance group, in plan.instances order sorted by max_len

    @property
    def makespan_s(self) -> float:
        return max(self.t_train_s, self.t_rollout_s)


def price(plan: Plan, cluster: ClusterSpec | str, model: ModelSpec | str, history: Sequence[tuple[int, ...]],
          cfg: PlannerConfig | None = None) -> PlanPrice:
    """Predicted per-step times of `plan` (unchanged) for requests drawn like `history`."""
    cfg = cfg or PlannerConfig()
    cluster, model = load_cluster(cluster), load_model(model)
    arr = _validate(cluster, history, cfg)
    hist = np.stack([arr[:, 1] - arr[:, 2], arr[:, 1]], axis=1) if arr.shape[1] == 3 else arr[:, :2]
    finals = hist[:, 1].astype(float)
    st = BatchStats(cfg.global_batch, cfg.global_batch * float(finals.mean()),
                    cfg.global_batch * float((finals**2).mean()), int(finals.max()))
    tc = TrainCost(cluster, model, recompute=cfg.recompute, logprob_passes=cfg.logprob_passes)
    t_train = tc.step_time_s(plan.train, st)
    p, o, w, _, _ = sample_history(hist, cfg.n_samples, cfg.global_batch)
    f = p + o
    groups = sorted((i for i in plan.instances if not i.filler), key=lambda i: i.max_len)  # fillers: capacity only
    edges = [g.max_len for g in groups[:-1]]
    which = np.searchsorted(np.asarray(edges, dtype=float), f, side="left")  # f <= max_len -> that group
    # "unbounded" admission: the window's batches are in flight, unless the loop caps them (max_in_flight)
    window_trajs = cfg.rollout_window * cfg.global_batch
    in_flight_share = min(1.0, cfg.max_in_flight / window_trajs) if cfg.max_in_flight > 0 else 1.0

    def group_costs(step_s: float) -> list[float]:
        costs = []
        for gi, g in enumerate(groups):
            sel = which == gi
            if not sel.any():
                costs.append(0.0)
                continue
            rc = RolloutCost(cluster.hardware, model, g.tp, cfg.max_running)
            W = float(w[sel].sum())
            if f[sel].max() > rc.kv_capacity_tokens():
                costs.append(float("inf"))
                continue
            mp, mo = float((w[sel] * p[sel]).sum() / W), float((w[sel] * o[sel]).sum() / W)
            res = (float((w[sel] * o[sel] ** 2).sum() / W) / (2.0 * mo) if cfg.length_biased_kv and mo > 0 else None)
            n_req = max(W / g.count, min(1.0, W))
            t = float(rc.group_makespan_s(n_req, mp, mo, float(o[sel].max()), float(f[sel].max()),
                                          window=cfg.rollout_window, reprefill=cfg.reprefill_on_sync,
                                          slot_output=cfg.slot_output, slot_wait_s=cfg.slot_wait_s,
                                          resident_output=res, step_s=step_s))
            if cfg.admission == "unbounded" and cfg.tool_returns > 0:
                t += float(rc.evicted_reprefill_s(n_req, n_req * cfg.rollout_window * in_flight_share,
                                                  rc.resident_context(mp, mo, cfg.rollout_window, res),
                                                  cfg.tool_returns, mp + mo / 2.0))
            costs.append(t)
        return costs

    def step_of(costs: list[float]) -> float:  # the predicted step in measured seconds
        return max(t_train * cfg.train_factor, (max(costs) if costs else 0.0) * cfg.rollout_factor)

    costs = group_costs(0.0)
    if cfg.mode == "async" and cfg.sustained_concurrency and costs and np.isfinite(max(costs)):
        costs = sustained_fixed_point(group_costs, step_of, costs, cfg.rollout_factor)
    rf = cfg.rollout_factor
    return PlanPrice(t_train * cfg.train_factor, (max(costs) if costs else 0.0) * rf, tuple(c * rf for c in costs))


def price_terms(plan: Plan, cluster: ClusterSpec | str, model: ModelSpec | str, history: Sequence[tuple[int, ...]],
                cfg: PlannerConfig) -> tuple[float, float, float]:
    """(T_train, T_rollout, final-length tokens of the batch priced) of `plan` on `history`: what the controller's
    online calibration fits its factors to (control.CalibratedPlanSource.price_terms), for the simulator's and
    the live plan source alike."""
    p = price(plan, cluster, model, history, cfg)
    tokens = cfg.global_batch * sum(h[1] for h in history) / max(1, len(history))
    return p.t_train_s, p.t_rollout_s, tokens
