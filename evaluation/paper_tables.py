"""The docs/simulator.md tables against the Libra paper: throughput and ablation in both units, per truth profile.

python -m evaluation.paper_tables [--steps 60] [--seed 0] [--truth default paper-level] [--workloads ...]
    [--out DIR]

Runs the pinned CLIs (`python -m evaluation.throughput|ablation ... --json --truth T`) once per workload and
profile, keeps each JSON under --out (default: a temporary folder) and prints Markdown tables: model-generated
tokens/s and, in parentheses, the paper's unit (input + output tokens of the trained trajectories per second,
whole cluster), and the R2E-Gym ablation ladder next to the paper's 423 / 510 / 551 / 666 / 763.
Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from areal_libra.sim.hardware import TRUTH_PROFILES
from areal_libra.sim.systems import LADDER, SYSTEMS
from areal_libra.utils import atomic_write_text

WORKLOADS = ("search_r1", "dapo_math", "r2e_gym")
# The paper's R2E-Gym ablation (tokens/s in its unit): Static-Uniform, + homogeneous planning, +
# heterogeneous TP (+41), + C-MLFQ (+115), + elastic execution (+97).
PAPER_R2E_LADDER = {"static_uniform": 423, "+planner": 510, "+hetero_tp": 551, "+cmlfq": 666, "+elastic": 763}


def run_cli(script: str, workload: str, truth: str, steps: int, seed: int, out: Path) -> dict:
    path = out / f"{script}_{workload}_{truth}.json"
    if path.exists():  # a kept run (same --out) is reused, so an interrupted regeneration resumes
        return json.loads(path.read_text())
    cmd = [sys.executable, "-m", f"evaluation.{script}", "--workload", workload, "--cluster", "a800x48",
           "--model", "qwen3-14b", "--steps", str(steps), "--seed", str(seed), "--json", "--truth", truth]
    print("$ " + " ".join(["python"] + cmd[1:]), file=sys.stderr, flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[1:])} failed: {p.stderr.strip().splitlines()[-1:]}")
    atomic_write_text(path, p.stdout)
    return json.loads(p.stdout)


def cell(r: dict) -> str:
    return f"{r['tokens_per_s']:,.0f} ({r['paper_tokens_per_s']:,.0f})"


def table(title: str, names, runs: dict[str, dict]) -> list[str]:
    """One row per system, one column per workload; a run kept from before a system existed shows "—"."""
    lines = [f"| {title} | " + " | ".join(runs) + " |", "| --- | " + " | ".join("---" for _ in runs) + " |"]
    for n in names:
        lines.append(f"| {n} | " + " | ".join(cell(runs[w]["systems"][n]) if n in runs[w]["systems"] else "—"
                                             for w in runs) + " |")
    return lines


def cost_lines() -> list[str]:
    """Per-cost figures of each truth profile (48 A800, Qwen3-14B): what "Where an order of magnitude goes" quotes."""
    from areal_libra.sim.hardware import truth_for

    truths = {name: truth_for("a800", "qwen3-14b", c) for name, c in TRUTH_PROFILES.items()}
    rows = [
        ("decode iteration, TP1, batch 1, 8K context (ms)", lambda t: 1e3 * t.decode_iteration_s(1, 1, 8192)),
        ("decode iteration, TP8, batch 1, 8K context (ms)", lambda t: 1e3 * t.decode_iteration_s(8, 1, 8192)),
        ("decode iteration, TP2, batch 2, 8K context each (ms)", lambda t: 1e3 * t.decode_iteration_s(2, 2, 16384)),
        ("decode iteration, TP2, batch 64, 8K context each (ms)",
         lambda t: 1e3 * t.decode_iteration_s(2, 64, 64 * 8192)),
        ("training step, 128 x 8K tokens, TP8 x DP4 (s)", lambda t: t.train_step_s([8192] * 128, 8, 1, 4, 32)),
        ("  of which: FLOPs per parameter per token", lambda t: t.c.train_passes),
        ("  of which: MFU at TP8", lambda t: t.c.train_mfu / (1.0 + t.c.train_tp_overhead * 3)),
        ("weight sync per step (s)", lambda t: t.weight_sync_s(8)),
        ("trajectories in flight (0 = only the staleness bound)", lambda t: t.c.max_in_flight),
        ("tool latency scale", lambda t: t.c.tool_latency_scale),
    ]
    out = ["| cost | " + " | ".join(f"`{n}`" for n in truths) + " |", "| --- | " + " | ".join("---" for _ in truths) + " |"]
    for label, f in rows:
        out.append(f"| {label} | " + " | ".join(f"{f(t):,.2f}".rstrip("0").rstrip(".") for t in truths.values()) + " |")
    return out


def _split(r: dict) -> str:
    """'train/rollout GPUs at the start, rollout servers at the end' of one system at a regime point."""
    start = r["split_start"].replace("train ", "").replace(" / rollout ", "/")
    mix = r["layout_end"].rsplit("(", 1)[-1].rstrip(")")
    return f"{start}, {mix}"


def regime_lines(path: str) -> list[str]:
    """A regime map's JSON (python -m evaluation.regimes --json) as a Markdown table in both units."""
    d = json.loads(Path(path).read_text())
    out = [f"truth `{d.get('truth', 'default')}`, {d['steps']} steps, seed {d['seed']}: tokens/s (paper's unit)", "",
           "| axis | value | libra / static | static: split, servers | static | libra: first split, last servers | libra |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in d["points"]:
        s_, lb = r["areal_static_optimal"], r["libra"]
        val = "—" if r["value"] is None else f"{r['value']:,}" if isinstance(r["value"], int) else str(r["value"])
        out.append(f"| {r['axis']} | {val} | {r['libra_over_static']:.2f} | {_split(s_)} | {cell(s_)} | {_split(lb)} "
                   f"| {cell(lb)} |")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--truth", nargs="+", default=["default", "paper-level"], choices=sorted(TRUTH_PROFILES))
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--out", default=None, help="folder for the JSON of each run (kept; reused when present)")
    ap.add_argument("--costs", action="store_true", help="print only the per-cost figures of each truth profile")
    ap.add_argument("--regimes", default=None, metavar="JSON",
                    help="print only this regime map (python -m evaluation.regimes --json) in both units")
    args = ap.parse_args(argv)
    if args.costs:
        print("\n".join(cost_lines()))
        return 0
    if args.regimes:
        try:
            print("\n".join(regime_lines(args.regimes)))
        except (OSError, ValueError, KeyError) as e:
            print(f"error: {args.regimes}: {e}", file=sys.stderr)
            return 2
        return 0
    if args.steps < 1:
        print("error: --steps must be >= 1", file=sys.stderr)
        return 2
    out = Path(args.out or tempfile.mkdtemp(prefix="paper_tables_"))
    out.mkdir(parents=True, exist_ok=True)
    try:
        for truth in args.truth:
            thr = {w: run_cli("throughput", w, truth, args.steps, args.seed, out) for w in args.workloads}
            abl = {w: run_cli("ablation", w, truth, args.steps, args.seed, out) for w in args.workloads}
            print(f"\n### truth `{truth}`, {args.steps} steps, seed {args.seed}: tokens/s (paper's unit)\n")
            print("\n".join(table("system", SYSTEMS, thr)))
            print()
            print("\n".join(table("ablation", LADDER, abl)))
            if "r2e_gym" in abl:
                sysr = abl["r2e_gym"]["systems"]
                print(f"\nR2E-Gym ladder, truth `{truth}` vs the paper (paper's unit, tokens/s):\n")
                print("| rung | simulated | paper |\n| --- | --- | --- |")
                for n in LADDER:
                    print(f"| {n} | {sysr[n]['paper_tokens_per_s']:,.0f} | {PAPER_R2E_LADDER[n]:,} |")
    except (RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"\nJSON of every run: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
