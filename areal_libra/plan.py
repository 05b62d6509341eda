"""python -m areal_libra.plan --cluster C --model M (--trace FILE | --lengths FILE) [--json] [--explain]
[--allowed-tp 1,2,4,8] [--global-batch N]

With --trace only the trajectories' model tokens count as decoded (prompt and tool returns are prefilled);
with --lengths everything after the prompt counts as decoded.

Plans the training/rollout split, the training parallelism and the rollout server mix for a cluster from a
length history. Bad input prints one line naming the problem on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from areal_libra.cost.presets import PresetError, load_cluster, load_model
from areal_libra.planner import PlanError, PlannerConfig, solve
from areal_libra.trace import TraceError, read_lengths, read_traces


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump
        raise _UsageError(message)


class _UsageError(Exception):
    pass


def _tp_list(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise _UsageError(f"--allowed-tp must be comma-separated integers, got '{text}'") from None
    if not vals or any(v < 1 for v in vals):
        raise _UsageError(f"--allowed-tp needs positive integers, got '{text}'")
    return vals


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m areal_libra.plan", description=__doc__.split("\n\n")[1])
    p.add_argument("--cluster", required=True, help="preset (a800x48, h100x64, cpu, <hw>x<N>) or YAML path")
    p.add_argument("--model", required=True, help="preset (qwen3-14b, ...) or YAML path")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", nargs="+", help="canonical or PolyTrace trace file(s), .jsonl[.gz]")
    src.add_argument("--lengths", help="file of 'prompt_tokens,final_length' lines")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--explain", action="store_true", help="print the decision tree and the DP intervals")
    p.add_argument("--allowed-tp", default=None, help="rollout TP degrees (default 1,2,4,8 up to a node)")
    p.add_argument("--global-batch", type=int, default=PlannerConfig.global_batch,
                   help="sequences per training step (default %(default)s)")
    p.add_argument("--samples", type=int, default=PlannerConfig.n_samples, help="history sample size for the DP")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        tps = _tp_list(args.allowed_tp) if args.allowed_tp is not None else PlannerConfig.allowed_tp
        cfg = PlannerConfig(allowed_tp=tps, global_batch=args.global_batch,
                            n_samples=args.samples)
        cluster = load_cluster(args.cluster)
        model = load_model(args.model)
        if args.trace:
            # model tokens are decoded; prompt and tool returns are prefilled
            history = [(t.prompt_tokens, t.final_length, t.model_tokens) for t in read_traces(args.trace)]
        else:
            history = read_lengths(args.lengths)
        if not history:
            raise PlanError(f"{args.lengths or args.trace[0]}: no requests in the history")
        plan = solve(cluster, model, history, cfg)
    except (_UsageError, PresetError, PlanError, TraceError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        if args.json:
            print(json.dumps(plan.to_json()))
        else:
            print(plan.summary())
        if args.explain:
            print(plan.explain(), file=sys.stderr if args.json else sys.stdout)
        sys.stdout.flush()
    except BrokenPipeError:  # e.g. piped into `head`: not an error of the planner
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
