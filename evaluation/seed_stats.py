"""Pool the JSON of several simulated runs of one setting over seeds and compare each system with the one listed
before it, paired by seed: `python -m evaluation.ablation ... --seeds 0 1 2 3 4 --json > A.json` and
`... --seeds 5 6 7 8 9 --json > B.json` run in two processes, then `python -m evaluation.seed_stats A.json
B.json`. Accepts the JSON of `--seeds` runs and of single-seed runs (evaluation.ablation, evaluation.throughput).
The runs must share every setting but the seed; a seed given twice must carry the same figures."""

from __future__ import annotations

import argparse
import json
import sys

from areal_libra.sim.report import seed_summary, seed_table
from areal_libra.utils import first_line

# What must agree between the pooled runs (everything in a run's JSON that describes its setting).
SETTING = ("workload", "cluster", "model", "steps", "batch_prompts", "group_size", "truth", "scale",
           "max_concurrent_rollouts")


def runs_of(path: str) -> list[dict]:
    """The single-seed runs one output file holds."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({first_line(e)})") from None
    if isinstance(doc, dict) and isinstance(doc.get("runs"), dict):
        runs = list(doc["runs"].values())
    elif isinstance(doc, dict) and "systems" in doc:
        runs = [doc]
    else:
        raise ValueError(f"{path}: not the JSON of evaluation.ablation or evaluation.throughput (--json)")
    for r in runs:
        if not isinstance(r.get("systems"), dict) or "seed" not in r:
            raise ValueError(f"{path}: a run without 'systems' or 'seed'")
    return runs


def pool(paths: list[str]) -> tuple[dict, dict[int, dict]]:
    """(the shared setting, seed -> {system: result}) of every run in `paths`, in the first file's system order."""
    setting: dict | None = None
    order: list[str] | None = None
    by_seed: dict[int, dict] = {}
    for path in paths:
        for r in runs_of(path):
            s = {k: r.get(k) for k in SETTING}
            if setting is None:
                setting, order = s, list(r["systems"])
            elif s != setting:
                k = next(k for k in SETTING if s[k] != setting[k])
                raise ValueError(f"{path}: seed {r['seed']} was run with {k}={s[k]!r}, the first run with "
                                 f"{setting[k]!r}")
            if set(r["systems"]) != set(order):
                raise ValueError(f"{path}: seed {r['seed']} ran {sorted(r['systems'])}, the first run {sorted(order)}")
            seed = int(r["seed"])
            figs = {n: r["systems"][n]["tokens_per_s"] for n in order}
            if seed in by_seed and {n: by_seed[seed][n]["tokens_per_s"] for n in order} != figs:
                raise ValueError(f"{path}: seed {seed} appears twice with different figures")
            by_seed[seed] = {n: r["systems"][n] for n in order}
    if setting is None:
        raise ValueError("no run given")
    return setting, dict(sorted(by_seed.items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="JSON outputs of evaluation.ablation / evaluation.throughput")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        setting, runs = pool(args.files)
    except ValueError as e:
        print(f"error: {first_line(e)}", file=sys.stderr)
        return 2
    summary = seed_summary(runs)
    if args.json:
        print(json.dumps({"setting": setting, "seeds": list(runs), "mean": summary}, indent=1))
    else:
        print(" ".join(f"{k}={setting[k]}" for k in SETTING) + f" seeds={' '.join(map(str, runs))}")
        print(seed_table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
