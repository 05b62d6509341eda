"""Shared plumbing of evaluation/throughput.py and evaluation/ablation.py: build the environment, run a
list of systems, print a table or JSON, draw figures. Errors surface as one line on stderr."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Sequence

from areal_libra.control.prediction import prediction_summary
from areal_libra.sim.cluster import SimError
from areal_libra.sim.hardware import GPUS, TRUTH_PROFILES, truth_constants, truth_for, truth_from_specs
from areal_libra.sim.libra import RANKING_PROBES
from areal_libra.sim.registry import run_system
from areal_libra.sim.seeds import paired_changes
from areal_libra.sim.systems import Env, SimKnobs, parse_knobs
from areal_libra.sim.workloads import make_workload
from areal_libra.trace import TraceError
from areal_libra.utils import first_line

_CLUSTER_RE = re.compile(r"^([a-z0-9_.-]+?)x(\d+)$")


# --scale presets: (GRPO groups per step, samples per prompt, max context). "paper": the paper's global batch,
# 2,048 trajectories a step (128 prompts x 16 samples) with a 40,960-token cap; "default": each workload's
# scaled-down batch (docs/simulator.md). --batch-prompts / --group-size override a preset's numbers.
SCALES = {"default": (None, None, None), "paper": (128, 16, 40960)}


def make_env(workload: str, cluster: str, model: str, seed: int = 0, batch_prompts: int | None = None,
             group_size: int | None = None, knobs: SimKnobs | None = None, truth: str = "default",
             scale: str = "default", max_concurrent_groups: int | None = 0) -> Env:
    consts = truth_constants(truth)
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; choose from {', '.join(SCALES)}")
    sb, sg, sl = SCALES[scale]
    batch_prompts = sb if batch_prompts is None else batch_prompts
    group_size = sg if group_size is None else group_size
    wl = make_workload(workload)
    if sl is not None:
        wl.cfg.max_len = sl
    if batch_prompts is not None:
        if batch_prompts < 1:
            raise ValueError("--batch-prompts must be >= 1")
        wl.cfg.batch_prompts = batch_prompts
    if group_size is not None:
        if group_size < 1:
            raise ValueError("--group-size must be >= 1")
        wl.cfg.group_size = group_size
    try:
        from areal_libra.cost.presets import load_cluster, load_model
    except ImportError:  # planner presets not installed: spec sheets of the simulator's own table
        m = _CLUSTER_RE.match(cluster.lower())
        if not m or m.group(1) not in GPUS:
            raise ValueError(f"unknown cluster {cluster!r}: use <gpu>x<count> with gpu in {', '.join(GPUS)}") from None
        return Env(truth_for(m.group(1), model, consts), wl, int(m.group(2)), seed=seed, knobs=knobs or SimKnobs(),
                   max_concurrent_groups=max_concurrent_groups)
    cl = load_cluster(cluster)
    md = load_model(model)
    return Env(truth_from_specs(cl.hardware, md, consts), wl, cl.n_gpus, cluster=cl, model=md, seed=seed,
               knobs=knobs or SimKnobs(), max_concurrent_groups=max_concurrent_groups)


def add_roofline(res: dict, sim) -> None:
    """The run's roofline bound (areal_libra.sim.roofline) and the system's throughput as a fraction of it."""
    from areal_libra.sim.roofline import roofline

    roof = roofline(sim.truth, sim.trained, sim.n_gpus, sim.cfg.max_running)
    res["roofline_tokens_per_s"] = roof["roofline_tokens_per_s"]
    res["roofline_frac"] = res["tokens_per_s"] / roof["roofline_tokens_per_s"] if roof["roofline_tokens_per_s"] else 0.0


def add_paper_unit(res: dict, records: Sequence[dict]) -> None:
    """Throughput in the Libra paper's unit: input (prompt) plus output (model-generated) tokens of the
    trajectories training consumed, per second of wall time, whole cluster. Libra's public analysis script
    (scripts/analyze_libra_experiment.py, `_tokens_per_second`) sums `input_len + output_len` of a step's
    sequences, where the workflows set input_len to the prompt and output_len to the loss-masked generated
    tokens (tool returns count in neither), and divides by the step's wall time. `paper_tokens_per_s` is
    the run's total over its wall time (like `tokens_per_s`); `paper_tokens_per_s_step_mean` is the
    script's own average, the mean over steps of each step's rate."""
    wall = records[-1]["t_end"] if records else 0.0
    total = sum(r["tokens"] + r["prompt_tokens"] for r in records)
    res["paper_tokens_per_s"] = total / wall if wall > 0 else 0.0
    rates = [(r["tokens"] + r["prompt_tokens"]) / r["interval_s"] for r in records if r["interval_s"] > 0]
    res["paper_tokens_per_s_step_mean"] = sum(rates) / len(rates) if rates else 0.0


def add_version_lag(res: dict, sim) -> None:
    """The version lag of the trajectories the system trained on: the trainer's version when a step trained
    a trajectory minus the policy version the trajectory started generating with (a trajectory whose
    generation spanned weight updates counts with the version it started with, AReaL's head version).
    0 is on-policy. `version_lag_eta` is the system's staleness bound (AReaL max_head_offpolicyness; 0 for
    synchronous verl), `version_lag_over_eta` the share of trained trajectories above it: AReaL's rule bounds
    how far admission runs ahead of training, not the age of a straggler trained later."""
    lags = sim.staleness_seen  # one per trained GRPO group, whose trajectories all start with its version
    eta = sim.cfg.max_staleness
    n = len(lags)
    # Every group holds the workload's group_size trajectories, so the mean over groups is the mean over
    # trajectories.
    res["version_lag_mean"] = sum(lags) / n if n else 0.0
    res["version_lag_max"] = max(lags) if n else 0
    res["version_lag_eta"] = eta
    res["version_lag_over_eta"] = sum(1 for x in lags if x > eta) / n if n else 0.0


def run_many(names: Sequence[str], env: Env, steps: int, log=None) -> tuple[dict, dict]:
    out, sims = {}, {}
    for n in names:
        t0 = time.time()
        res, sim = run_system(n, env, steps)
        res["sim_wall_s"] = round(time.time() - t0, 2)
        add_roofline(res, sim)
        add_paper_unit(res, sim.records)
        add_version_lag(res, sim)
        if "predictions" in res:  # a Libra rung: its decisions' predictions against the next measured steps
            res["prediction_check"] = prediction_summary(res["predictions"])
        out[n] = res
        sims[n] = sim
        if log:
            log(f"{n}: {res['tokens_per_s']:.0f} tokens/s ({res['sim_wall_s']} s to simulate)")
    return out, sims


KEYS = ("tokens_per_s", "mean_step_s", "rollout_busy_frac", "train_busy_frac", "reconfigurations")


def _frac(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(results: dict, ref: str | None) -> str:
    lines = [f"{'system':24s} {'tokens/s':>10s} {'paper t/s':>10s} {'vs ' + (ref or '-'):>18s} {'of roof':>7s} "
             f"{'step s':>8s} {'roll busy':>9s} {'train busy':>10s} {'reconf':>6s} {'lag':>5s} {'stale':>5s} "
             f"{'migr':>5s} {'fallbk':>6s}"]
    base = results.get(ref, {}).get("tokens_per_s") if ref else None
    for n, r in results.items():
        rel = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        roof = f"{r['roofline_frac']:.2f}" if "roofline_frac" in r else "-"
        paper = f"{r['paper_tokens_per_s']:.0f}" if "paper_tokens_per_s" in r else "-"
        lines.append(f"{n:24s} {r['tokens_per_s']:10.0f} {paper:>10s} {rel:>18s} {roof:>7s} {r['mean_step_s']:8.1f} "
                     f"{r['rollout_busy_frac']:9.2f} {r['train_busy_frac']:10.2f} {r['reconfigurations']:6d} "
                     f"{r.get('version_lag_mean', 0.0):5.2f} {r['max_staleness']:5d} "
                     f"{r.get('migrated_token_ratio', 0.0):5.2f} {_frac(r.get('fallback_fraction')):>6s}")
    return "\n".join(lines)


def prediction_lines(results: dict) -> list[str]:
    """For each Libra rung: its decisions' predictions against the mean of the next measured steps, and the
    calibrated evaluator's ranking of AReaL-Static-Optimal's candidates (Spearman) as each loop runs them,
    where that loop's sweep was cached."""
    lines = []
    for n, r in results.items():
        pc = r.get("prediction_check")
        if pc is not None:
            lo, hi = pc["band"]
            rows = ", ".join(f"{d['step']} {d['kind']} {d['ratio']:.2f}" for d in pc["decisions"]) or "none"
            lines.append(f"{n} predictions (predicted / mean of the next 5 steps): {rows}; re-plans and elastic moves "
                         f"within {lo}-{hi}: {'yes' if pc['moves_within'] else 'no'} ({pc['n_moves']} scored)")
        for key, _, loop in RANKING_PROBES.values():
            rk = r.get(key)
            if rk is not None and rk["spearman"]:
                lines.append(f"{n} ranking of AReaL-Static-Optimal's {rk['n_candidates']} candidates, as {loop} runs "
                             f"them, by the calibrated evaluator, steps {rk['steps'][0]}-{rk['steps'][-1]}: Spearman "
                             f"min {rk['min']:.2f} mean {rk['mean']:.2f} (last step's best "
                             f"{rk['last_predicted_best']}, measured best {rk['measured_best']})")
    return lines


def plot(path: str, title: str, results: dict, sims: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ax = axes[0]
    vals = [results[n]["tokens_per_s"] for n in names]
    ax.bar(range(len(names)), vals, color=["#888"] * (len(names) - 1) + ["#c33"])
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("tokens/s")
    ax.set_title(title)
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.0f}", ha="center", va="bottom", fontsize=7)
    for n in names:
        recs = sims[n].records
        steps = [r["step"] for r in recs]
        tps = [r["tokens"] / max(1e-9, r["interval_s"]) for r in recs]
        k = max(1, len(tps) // 20)
        sm = [sum(tps[max(0, i - k + 1): i + 1]) / len(tps[max(0, i - k + 1): i + 1]) for i in range(len(tps))]
        axes[1].plot(steps, sm, label=n, lw=1)
        axes[2].plot(steps, [r["rollout_gpus"] for r in recs], label=n, lw=1)
    axes[1].set_xlabel("training step")
    axes[1].set_ylabel("tokens/s (moving mean)")
    axes[1].set_title("throughput over training")
    axes[2].set_xlabel("training step")
    axes[2].set_ylabel("rollout GPUs")
    axes[2].set_title("allocation over training")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def parse_common(argv, description: str, names: Sequence[str], default_ref: str):
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--workload", required=True, help="search_r1 | dapo_math | r2e_gym | PATH to a trace")
    ap.add_argument("--cluster", default="a800x48")
    ap.add_argument("--model", default="qwen3-14b")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--seed", type=int, default=None, help="the run's seed (default 0)")
    ap.add_argument("--seeds", type=int, nargs="+", default=None, metavar="SEED",
                    help="run every system once per seed and report each run and the mean over the seeds (a "
                         "single seed's comparison can turn on one straggler's wait)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--systems", nargs="+", default=list(names), help=f"subset of: {' '.join(names)}")
    ap.add_argument("--plot", default=None, help="write a PNG figure here")
    ap.add_argument("--batch-prompts", type=int, default=None,
                    help="GRPO groups per step (scale knob; defaults per workload, see README)")
    ap.add_argument("--group-size", type=int, default=None, help="samples per prompt")
    ap.add_argument("--scale", default="default", choices=sorted(SCALES),
                    help="batch preset: paper = 128 prompts x 16 samples (2,048 trajectories a step), 40,960-token "
                         "cap; --batch-prompts/--group-size override it")
    ap.add_argument("--knob", action="append", default=[], metavar="KEY=VALUE",
                    help="a simulator switch (areal_libra.sim.systems.SimKnobs), e.g. replan=false")
    ap.add_argument("--truth", default="default", choices=sorted(TRUTH_PROFILES),
                    help="hardware truth profile (areal_libra/sim/hardware.py TRUTH_PROFILES; docs/simulator.md)")
    ap.add_argument("--max-concurrent-rollouts", default="0", metavar="N|batch",
                    help="AReaL's rollout.max_concurrent_rollouts (GRPO groups running at once) for every AReaL-loop "
                         "system: 0 (default) only the staleness bound, as the emulated experiment's 8192; batch: "
                         "AReaL's own default, the consumer batch")
    return ap.parse_args(argv)


def parse_max_concurrent(value: str) -> int | None:
    """--max-concurrent-rollouts: 'batch' -> None (AReaL's default), else a count >= 0."""
    if value == "batch":
        return None
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"--max-concurrent-rollouts must be a count >= 0 or 'batch', not {value!r}")
    return n


def _json_of(args, env: Env, results: dict, seed: int) -> dict:
    wname = getattr(env.workload, "name", args.workload)
    return {"systems": results, "workload": wname, "cluster": args.cluster, "model": args.model,
            "steps": args.steps, "seed": seed,
            "batch_prompts": env.workload.cfg.batch_prompts,
            "group_size": env.workload.cfg.group_size, "truth": args.truth, "scale": args.scale,
            "max_concurrent_rollouts": args.max_concurrent_rollouts,
            # AReaL-Static-Optimal's sweep: every candidate layout with its measured tokens/s
            "baseline_candidates": results.get("areal_static_optimal", {}).get("baseline_candidates"),
            # the same layouts under Libra's loop (static_libra_loop's sweep)
            "loop_candidates": results.get("static_libra_loop", {}).get("loop_candidates")}


def _print_run(args, env: Env, results: dict, seed: int, default_ref: str) -> None:
    wname = getattr(env.workload, "name", args.workload)
    print(f"workload={wname} cluster={args.cluster} ({env.n_gpus} GPUs) model={args.model} steps={args.steps} "
          f"seed={seed} batch={env.workload.cfg.batch_prompts}x{env.workload.cfg.group_size} truth={args.truth}")
    print(table(results, default_ref if default_ref in results else None))
    for line in prediction_lines(results):
        print(line)


def seed_summary(runs: dict[int, dict]) -> dict[str, dict]:
    """Per system over the seeds' runs (seed -> {system: result}): mean, min and max tokens/s, the mean's
    change against the system listed before it (a ladder's rung against the one below), in percent, and
    `paired`: that change seed by seed, its mean and 95% interval (areal_libra.sim.seeds.paired_changes)."""
    names = list(next(iter(runs.values())))
    paired = paired_changes({s: {n: r[n]["tokens_per_s"] for n in names} for s, r in runs.items()}, names)
    out: dict[str, dict] = {}
    prev = None
    for n in names:
        vals = [r[n]["tokens_per_s"] for r in runs.values()]
        mean = sum(vals) / len(vals)
        out[n] = {"mean_tokens_per_s": mean, "min_tokens_per_s": min(vals), "max_tokens_per_s": max(vals),
                  "change_pct": None if prev is None or prev <= 0 else 100.0 * (mean / prev - 1.0),
                  "paired": paired.get(n)}
        prev = mean
    return out


def seed_table(summary: dict[str, dict]) -> str:
    """The human table of seed_summary: each system's mean and range, and its change against the one above,
    of the means and paired by seed (mean, 95% interval, the seeds more than 1% below)."""
    lines = [f"{'system':24s} {'mean t/s':>10s} {'min':>10s} {'max':>10s} {'vs above':>9s} "
             f"{'paired mean [95% CI]':>24s}  seeds < -1%"]
    for n, m in summary.items():
        ch = "-" if m["change_pct"] is None else f"{m['change_pct']:+.1f}%"
        p = m.get("paired")
        if p is None:
            pc, below = "-", ""
        else:
            ci = p["ci95_pct"]
            pc = f"{p['mean_pct']:+.1f}%" + ("" if ci is None else f" [{ci[0]:+.1f}, {ci[1]:+.1f}]")
            below = " ".join(map(str, p["seeds_below_floor"])) or "none"
        lines.append(f"{n:24s} {m['mean_tokens_per_s']:10.0f} {m['min_tokens_per_s']:10.0f} "
                     f"{m['max_tokens_per_s']:10.0f} {ch:>9s} {pc:>24s}  {below}")
    return "\n".join(lines)


def main_common(argv, description: str, names: Sequence[str], default_ref: str) -> int:
    args = parse_common(argv, description, names, default_ref)
    systems = [s for part in args.systems for s in part.split(",") if s]
    runs: dict[int, tuple[Env, dict, dict]] = {}
    try:
        bad = [s for s in systems if s not in names]
        if bad:
            raise ValueError(f"unknown system {bad[0]!r}; choose from {', '.join(names)}")
        if args.steps < 1:
            raise ValueError("--steps must be >= 1")
        if args.seeds is not None and args.seed is not None:
            raise ValueError("give --seed or --seeds, not both")
        if args.seeds is not None and len(set(args.seeds)) != len(args.seeds):
            raise ValueError(f"--seeds lists a seed twice: {args.seeds}")
        if args.seeds is not None and args.plot:
            raise ValueError("--plot draws one run: give it with --seed")
        seeds = args.seeds or [0 if args.seed is None else args.seed]
        log = None if args.json else (lambda m: print(m, file=sys.stderr))
        from areal_libra.sim.systems import check_cluster

        for seed in seeds:
            env = make_env(args.workload, args.cluster, args.model, seed, args.batch_prompts, args.group_size,
                           parse_knobs(args.knob), truth=args.truth, scale=args.scale,
                           max_concurrent_groups=parse_max_concurrent(args.max_concurrent_rollouts))
            check_cluster(env.truth, env.n_gpus)
            if log and len(seeds) > 1:
                log(f"seed {seed}:")
            results, sims = run_many(systems, env, args.steps, log)
            # The simulations are kept only for --plot, which draws a single run: over seeds, each run's
            # simulations (every server, request and record of a paper-scale run) are dropped once it ends.
            runs[seed] = (env, results, sims if args.seeds is None else {})
    except (ValueError, TraceError, SimError, OSError) as e:
        msg = first_line(e)
        print(f"error: {msg}", file=sys.stderr)
        return 2
    if args.seeds is None:
        seed, (env, results, sims) = next(iter(runs.items()))
        if args.json:
            print(json.dumps(_json_of(args, env, results, seed), indent=1))
        else:
            _print_run(args, env, results, seed, default_ref)
    else:
        summary = seed_summary({s: r for s, (_, r, _) in runs.items()})
        if args.json:
            print(json.dumps({"seeds": args.seeds, "mean": summary,
                              "runs": {str(s): _json_of(args, e, r, s) for s, (e, r, _) in runs.items()}}, indent=1))
        else:
            for s, (e, r, _) in runs.items():
                _print_run(args, e, r, s, default_ref)
                print()
            print(f"mean over seeds {' '.join(map(str, args.seeds))}:")
            print(seed_table(summary))
    if not args.json:
        print("tokens/s: model-generated tokens of the trained trajectories per second; paper t/s: the Libra "
              "paper's unit, input + output tokens of the trained trajectories per second, whole cluster")
        print("of roof: tokens/s as a fraction of the run's roofline bound (every GPU at the hardware truth's "
              "limit, perfect balance; areal_libra/sim/roofline.py)")
        print("lag / stale: mean / maximum version lag of the trained trajectories (trainer version minus the "
              "version a trajectory started with; --json: version_lag_*)")
        print("migr: migrated token ratio (re-prefilled context / final tokens); fallbk: share of C-MLFQ's routing "
              "decisions made by its least-loaded fallback (-: no C-MLFQ routing)")
    if args.plot:
        env, results, sims = next(iter(runs.values()))
        plot(args.plot, f"{getattr(env.workload, 'name', args.workload)} on {args.cluster}", results, sims)
    return 0
