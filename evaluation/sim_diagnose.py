"""Where Libra's plan and the simulated cluster disagree: the planner's predictions next to what the same
layout measures on the hardware truth, and how the planner ranks its own layout against the static
optimum found by the sweep.

python -m evaluation.sim_diagnose --workload r2e_gym [--cluster a800x48] [--model qwen3-14b] [--steps 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys

from areal_libra.sim import libra as sim_libra
from areal_libra.sim.cluster import RunConfig, SimError, Simulation
from areal_libra.sim.libra import layout_from_plan, plan_for, profile_history
from areal_libra.sim.report import make_env
from areal_libra.sim.systems import AREAL_STALENESS, SimKnobs, areal_static_optimal, policy_router
from areal_libra.trace import TraceError


def _measure(env, layout, eta: int, steps: int, routing: str, fit=None, flush: bool = True) -> dict:
    if routing == "cmlfq" and len(layout.bucket_limits) > 1:  # as Libra routes: C-MLFQ + spill-over
        router = sim_libra._router_for(layout, sim_libra.LibraOptions(elastic=False), None, fit, env.knobs)
    else:
        router = policy_router(routing if len(layout.bucket_limits) > 1 else "least_loaded")(layout)
    run = RunConfig(max_staleness=eta, flush_kv_on_sync=flush)
    sim = Simulation(env.truth, env.workload, env.n_gpus, layout, run, router, seed=env.seed)
    res = sim.run(steps)
    recs = sim.records[1:] or sim.records
    return {"tokens_per_s": res["tokens_per_s"], "train_s": statistics.mean(r["train_s"] for r in recs),
            "step_s": statistics.mean(r["interval_s"] for r in recs),
            "rollout_s": statistics.mean(r["interval_s"] - r["train_s"] for r in recs)}


def _cost_vs_truth(env) -> None:
    """The Cost Evaluator's decode step next to the truth's at the public TP table's operating point
    (320 running sequences, ~1,128 tokens of KV each), raw and after the profiling-pass calibration."""
    if env.cluster is None:
        return
    from areal_libra.cost.rollout import RolloutCost
    from areal_libra.sim.libra import planner_cluster

    cal = planner_cluster(env)
    print(f"Cost Evaluator vs hardware truth, {env.truth.model.name} on {env.truth.gpu.name}, decode step at "
          "320 running sequences:")
    for tp in (1, 2, 4, 8):
        truth = env.truth.decode_iteration_s(tp, 320, 320 * 1128)
        raw = float(RolloutCost(env.cluster.hardware, env.model, tp).decode_step_s(320, 320 * 1128))
        fit = float(RolloutCost(cal.hardware, env.model, tp).decode_step_s(320, 320 * 1128))
        print(f"  TP{tp}: truth {truth * 1e3:.1f} ms, cost model {raw * 1e3:.1f} ms raw ({truth / raw:.1f}x faster "
              f"than truth), {fit * 1e3:.1f} ms calibrated")
    err = getattr(env, "calibration_error", {})
    print("  calibration fit, mean relative error on the profiling samples: "
          + ", ".join(f"{k} {v:.0%}" for k, v in err.items()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", required=True)
    ap.add_argument("--cluster", default="a800x48")
    ap.add_argument("--model", default="qwen3-14b")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--planner-mode", choices=("window", "async"), default="async",
                    help="the planner's rollout objective (SimKnobs.planner_mode)")
    args = ap.parse_args(argv)
    try:
        env = make_env(args.workload, args.cluster, args.model, args.seed, knobs=SimKnobs(planner_mode=args.planner_mode))
        _cost_vs_truth(env)
        prof = env.workload.profile(env.profile_groups)
        hist = profile_history(prof)
        plan = plan_for(env, hist, homogeneous=False)
        lay = layout_from_plan(plan, env.workload.cfg.max_len, env.knobs.train_micro_batch)
        w = 1 if env.knobs.planner_mode == "async" else sim_libra.PLAN_WINDOW
        how = (f"asynchronous objective, staleness {AREAL_STALENESS}" if w == 1 else f"planning window {w} batches")
        print(f"Libra's initial plan ({how}):")
        print("  " + plan.summary().replace("\n", "\n  "))
        print(f"  predicted per step: T_train {plan.t_train_s / w:.1f} s, T_rollout {plan.t_rollout_s / w:.1f} s")
        sync = _measure(env, lay, 0, args.steps, "oracle")
        print(f"  measured, synchronous, oracle routing: T_train {sync['train_s']:.1f} s, rollout phase "
              f"{sync['rollout_s']:.1f} s per step")
        asy = _measure(env, lay, AREAL_STALENESS, args.steps, "least_loaded")
        print(f"  measured, asynchronous (staleness {AREAL_STALENESS}), least-loaded buckets: "
              f"{asy['tokens_per_s']:.0f} tokens/s, step {asy['step_s']:.1f} s, T_train {asy['train_s']:.1f} s")
        if len(lay.bucket_limits) > 1:
            # The planner sizes buckets as if every request ran in the bucket of its final length; routing by
            # final length (the oracle) and by C-MLFQ's prediction on the same layout show what that costs.
            ora = _measure(env, lay, AREAL_STALENESS, args.steps, "oracle")
            cm = _measure(env, lay, AREAL_STALENESS, args.steps, "cmlfq", prof)
            print(f"  same layout, asynchronous: oracle routing (final length) {ora['tokens_per_s']:.0f} tokens/s, "
                  f"step {ora['step_s']:.1f} s; C-MLFQ {cm['tokens_per_s']:.0f} tokens/s, step {cm['step_s']:.1f} s")
        homog = plan_for(env, hist, homogeneous=True)
        print(f"  planner's best homogeneous plan: {homog.rollout_alloc()}, makespan {homog.makespan_s / w:.1f} s per "
              f"step; predicted gain of the plan above: {1 - plan.makespan_s / homog.makespan_s:.1%}")
        best = areal_static_optimal(env).layout
        g = best.train.gpus
        tp = best.servers[0][0]
        asy_best = _measure(env, best, AREAL_STALENESS, args.steps, "least_loaded")
        print(f"Sweep's static optimum: {g} training GPUs ({best.train}), {best.rollout_gpus} rollout GPUs as TP{tp}")
        try:
            priced = plan_for(env, hist, homogeneous=True, min_train_gpus=g, max_train_gpus=g, allowed_tp=(tp,))
            print(f"  planner's prediction for it: makespan {priced.makespan_s / w:.1f} s per step "
                  f"(its own plan: {plan.makespan_s / w:.1f} s)")
        except (ValueError, SimError) as e:  # PlanError is a ValueError
            print(f"  the planner finds no plan with {g} training GPUs and TP{tp} only ({str(e).splitlines()[0]})")
        print(f"  measured, asynchronous: {asy_best['tokens_per_s']:.0f} tokens/s, step {asy_best['step_s']:.1f} s")
        # What the KV flush at each weight update costs (AReaL interrupts generation; requests re-prefill).
        nf_plan = _measure(env, lay, AREAL_STALENESS, args.steps, "least_loaded", flush=False)
        nf_best = _measure(env, best, AREAL_STALENESS, args.steps, "least_loaded", flush=False)
        print(f"KV flush at weight updates, least-loaded routing: Libra's plan {asy['tokens_per_s']:.0f} tokens/s "
              f"with it, {nf_plan['tokens_per_s']:.0f} without; sweep's optimum {asy_best['tokens_per_s']:.0f} with, "
              f"{nf_best['tokens_per_s']:.0f} without")
    except (ValueError, TraceError, SimError, OSError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
