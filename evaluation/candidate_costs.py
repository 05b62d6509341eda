"""What a static candidate layout spends its time on, and what the Cost Evaluator says it should.

    python -m evaluation.candidate_costs --workload r2e_gym --cluster a800x48 --model qwen3-14b \
        --batch-prompts 128 --group-size 16 [--seed 0] [--loop areal|libra] [--candidates 24x1 24x8 ...] [--json]

Each candidate (ROLLOUT_GPUSxTP, the training layout for the rest as AReaL-Static-Optimal's sweep sets it) runs
the sweep's stationary replay under AReaL's loop or Libra's (the version-lag bound and the working-set
admission), and over the sweep's steady window it reports: the step interval, the trainer's time and its wait
for rollout, the tokens the servers prefilled per final token of the trained trajectories (1 would be each
context prefilled once; more is re-prefill after KV evictions, preemptions and the weight update's flush), the
preemptions, and the rollout GPUs' busy share. Beside them the uncalibrated Cost Evaluator's terms for the same
layout, priced on the run's own finished trajectories and scaled to the trained batch's tokens: T_train
against the trainer's time, and T_rollout against the step on the steps where the trainer waited for rollout
(there rollout set the step). A simulator-side diagnostic: it reads the simulator's measurements as a profiler
would; the planner never does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from areal_libra.control.prediction import layout_plan
from areal_libra.cost.training import TrainParallel
from areal_libra.sim.cluster import SimError
from areal_libra.sim.libra import SimPlanSource, history_of, libra_run_config
from areal_libra.sim.report import make_env
from areal_libra.sim.systems import SWEEP_END, SWEEP_WARMUP, run_candidate, sweep_candidates
from areal_libra.trace import TraceError
from areal_libra.utils import first_line

DEFAULT = ("8x1", "8x8", "24x1", "24x2", "24x4", "24x8", "40x1", "40x8")


def parse_candidate(text: str) -> tuple[int, int]:
    """'24x8' -> (24 rollout GPUs, TP8)."""
    try:
        roll, tp = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"candidate {text!r} is not ROLLOUT_GPUSxTP (e.g. 24x8)") from None
    return roll, tp


def candidate_costs(env, roll: int, tp: int, loop: str = "areal") -> dict | None:
    """One candidate's measured costs and the evaluator's terms (see the module's doc); None when the layout
    does not fit the cluster."""
    run = libra_run_config(env) if loop == "libra" else None
    sim = run_candidate(env, roll, tp, run=run)
    if sim is None:
        return None
    recs = [r for r in sim.records if SWEEP_WARMUP <= r["step"] <= SWEEP_END]
    final = statistics.mean(r["final_tokens"] for r in recs)
    train_s = statistics.mean(r["train_s"] for r in recs)
    interval = statistics.mean(r["interval_s"] for r in recs)
    waited = [r for r in recs if r["wait_s"] > 0.05 * r["interval_s"]]
    t = sim.layout.train
    plan = layout_plan(roll, tp, TrainParallel(t.tp, t.pp, t.dp), env.workload.cfg.max_len, env.n_gpus)
    t_train, t_roll, priced = SimPlanSource(env, homogeneous=True).price_terms(plan, history_of(sim, 2000))
    per = final / priced if priced > 0 else 1.0  # the model's terms at the trained batch's tokens
    all_final = sum(r["final_tokens"] for r in sim.records)
    return {"rollout_gpus": roll, "tp": tp, "train": {"tp": t.tp, "pp": t.pp, "dp": t.dp, "gpus": t.gpus},
            "loop": loop, "step_s": interval, "train_s": train_s,
            "wait_s": statistics.mean(r["wait_s"] for r in recs), "waited_steps": len(waited),
            "prefill_per_final_token": sum(s.prefill_tokens for s in sim.servers) / max(1, all_final),
            "preemptions": sum(s.preemptions for s in sim.servers),
            "rollout_busy": sim.summary()["rollout_busy_frac"],
            "model_t_train_s": t_train * per, "model_t_rollout_s": t_roll * per,
            "model_over_measured_train": t_train * per / train_s if train_s > 0 else None,
            "model_over_measured_rollout": (t_roll * per / statistics.mean(r["interval_s"] for r in waited)
                                            if waited else None)}


def _fmt(x: float | None) -> str:
    return "   -" if x is None else f"{x:4.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", required=True)
    ap.add_argument("--cluster", default="a800x48")
    ap.add_argument("--model", default="qwen3-14b")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-prompts", type=int, default=None)
    ap.add_argument("--group-size", type=int, default=None)
    ap.add_argument("--loop", default="areal", choices=("areal", "libra"))
    ap.add_argument("--candidates", nargs="+", default=list(DEFAULT), metavar="ROLLxTP")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    try:
        env = make_env(a.workload, a.cluster, a.model, a.seed, a.batch_prompts, a.group_size)
        wanted = [parse_candidate(c) for c in a.candidates]
        known = set(sweep_candidates(env))
        bad = [f"{r}x{t}" for r, t in wanted if (r, t) not in known]
        if bad:
            raise ValueError(f"{bad[0]} is not one of the sweep's candidates on {a.cluster}")
        rows = []
        for roll, tp in wanted:
            row = candidate_costs(env, roll, tp, a.loop)
            if row is not None:
                rows.append(row)
                if not a.json:
                    print(f"{roll:>3}xTP{tp} train {row['train']['gpus']:>2}: step {row['step_s']:7.1f} s, train "
                          f"{row['train_s']:7.1f} s, wait {row['wait_s']:7.1f} s ({row['waited_steps']} of "
                          f"{SWEEP_END - SWEEP_WARMUP + 1} steps waited), prefill/final {row['prefill_per_final_token']:5.1f}, "
                          f"preemptions {row['preemptions']:6d}, rollout busy {row['rollout_busy']:.2f} | model / "
                          f"measured: train {_fmt(row['model_over_measured_train'])}, rollout "
                          f"{_fmt(row['model_over_measured_rollout'])}", flush=True)
    except (ValueError, SimError, TraceError, OSError) as e:
        print(f"error: {first_line(e)}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps({"workload": a.workload, "cluster": a.cluster, "seed": a.seed, "loop": a.loop,
                          "candidates": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
