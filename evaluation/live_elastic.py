"""The Elastic Hybrid Pool live, decided by the LibraController, while the emulated lengths grow.

    python -m evaluation.live_elastic [--steps 30] [--json] [--fileroot DIR] [--set key=value ...]

Runs `python -m areal_libra.launch experiment=dapo_math cluster=emulated libra.elastic.enabled=true` (one
hybrid replica serving rollout while in rollout, no join_at_step script) on an 8-accelerator emulated H100
cluster (4 prompts x 8 samples a step) whose generated lengths grow 40x over 20 steps, then prints, from the
run's files, every control decision (control_events.jsonl) and per step what the policy read: T_train,
T_rollout (the rollout side's busy time, areal_libra.elastic.measure), their ratio, the trainer's wait, the
rollout side's idle time, the emulated length multiplier and the trainer's emulated accelerators (4 + 1
while the hybrid trains). Early the short trajectories leave rollout idle most of the step (the trainer is
the bottleneck: the policy joins the hybrid); once they have grown rollout is the bottleneck (the policy
releases it). `--set` overrides any launch key (e.g. the defaults below).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from evaluation.launch_run import RunError, launch_run

DEFAULTS = {
    "libra.elastic.enabled": "true",
    "libra.emulated.accelerators": "8",  # 1 hybrid + what the planner splits (4 server processes at most)
    "libra.emulated.gpu": "h100",
    "libra.emulated.length_growth": "39.0",
    "libra.emulated.growth_horizon": "20",
    "libra.emulated.time_scale": "2.0",
    "libra.control.elastic_persist": "3",
    # A small batch: the emulated trainer's time is a fixed part (optimizer, weight update) plus one per token
    # of the batch, rollout's is the latency of the longest trajectory, so growing lengths tip the balance
    # towards rollout within the run (at 16 prompts the trainer stays the bottleneck throughout).
    "train_dataset.batch_size": "4",
}



def summarize(run_dir: Path) -> dict:
    """Events and the per-step view of the policy from a finished run directory."""
    mpath, epath = run_dir / "metrics.jsonl", run_dir / "control_events.jsonl"
    if not mpath.exists():
        raise RunError(f"{mpath}: no metrics written")
    events = [json.loads(x) for x in epath.read_text().splitlines() if x.strip()] if epath.exists() else []
    steps = []
    for line in mpath.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        # The controller's view (AReaL's train time, pacing included), else the pool's.
        tt = r.get("plan/obs_train_s", r.get("elastic/t_train_s"))
        tr = r.get("plan/obs_rollout_s", r.get("elastic/t_rollout_s"))
        steps.append({
            "step": r.get("step"), "step_s": r.get("step_time_s"),
            "length_x": r.get("emul/length_multiplier"),
            "t_train_s": tt, "t_rollout_s": tr, "ratio": (tt / tr) if tt and tr else None,
            "wait_s": r.get("elastic/rollout_wait_s"), "idle_s": r.get("elastic/rollout_idle_s"),
            "hybrids_training": r.get("elastic/hybrids_training", r.get("elastic/active_hybrids")),
            "train_accelerators": r.get("emul/train_accelerators"),
            "hybrid_routed": r.get("elastic/hybrid_routed"), "allocation": r.get("plan/allocation"),
        })
    kinds = [e["event"] for e in events]
    return {"run_dir": str(run_dir), "events": events, "joins": kinds.count("join"),
            "releases": kinds.count("release"), "steps": steps,
            "shows_join_and_release": "join" in kinds and "release" in kinds
            and kinds.index("join") < len(kinds) - 1 - kinds[::-1].index("release")}


def run(steps: int, root: Path, overrides: dict[str, str], log) -> Path:
    args = ["experiment=dapo_math", "cluster=emulated", f"total_train_steps={steps}", f"cluster.fileroot={root}",
            "trial_name=live-elastic", *(f"{k}={v}" for k, v in overrides.items())]
    return launch_run(args, "live_elastic", log)


def _fmt(x: object, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec) if isinstance(x, (int, float)) else str(x)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evaluation.live_elastic", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--fileroot", default=None, help="where the run writes (default: a temp dir)")
    ap.add_argument("--run-dir", default=None, help="summarize this finished run instead of launching one")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a launch override")
    args = ap.parse_args(argv)
    if args.steps < 1:
        print("error: --steps must be >= 1", file=sys.stderr)
        return 2
    bad = [s for s in args.set if "=" not in s]
    if bad:
        print(f"error: --set {bad[0]!r} is not of the form key=value", file=sys.stderr)
        return 2
    overrides = dict(DEFAULTS) | dict(s.split("=", 1) for s in args.set)
    try:
        if args.run_dir is not None:
            run_dir = Path(args.run_dir)
        else:
            root = Path(args.fileroot or tempfile.mkdtemp(prefix="live_elastic."))
            run_dir = run(args.steps, root, overrides, lambda m: print(m, file=sys.stderr, flush=True))
        out = summarize(run_dir)
    except (RunError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print("step  len_x  T_train  T_rollout  ratio  wait_s  idle_s  train_acc  step_s")
    for s in out["steps"]:
        print(f"{_fmt(s['step'], 'd'):>4}  {_fmt(s['length_x']):>5}  {_fmt(s['t_train_s']):>7}  "
              f"{_fmt(s['t_rollout_s']):>9}  {_fmt(s['ratio']):>5}  {_fmt(s['wait_s']):>6}  {_fmt(s['idle_s']):>6}  "
              f"{_fmt(s['train_accelerators'], '.0f'):>9}  {_fmt(s['step_s']):>6}")
    for e in out["events"]:
        print(f"step {e['step']}: {e['event']}: {e['detail'].splitlines()[0]}")
    print(f"joins {out['joins']}, releases {out['releases']}; run directory {out['run_dir']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
