"""How rollout latency and training time grow from 1K to 32K tokens in the simulator's hardware truth, next to the
Libra paper's motivation figure (rollout latency 95x, training time 3.9x from 1K to 32K tokens).

python -m evaluation.growth [--cluster a800x48] [--model qwen3-14b] [--truth default] [--rollout-gpus 16]
    [--rollout-tp 2] [--train-tp 8] [--train-gpus 32] [--prompt-tokens 256] [--json]

At the paper's scale (16 samples per prompt, 2,048 trajectories a step) and its production split (32 training
GPUs as Megatron TP8 x DP4, 16 rollout GPUs), every trajectory one turn of L tokens (prompt + generated, no
tools), three ways of holding the step fixed:

- batch: 2,048 trajectories a step, so the tokens per step grow with L (32x from 1K to 32K);
- tokens: 2,048 x 1K tokens a step, so the batch shrinks as L grows (64 trajectories at 32K);
- one request: a single trajectory alone on one rollout server (its decode latency; KV never binds).

Rollout latency is the makespan of the step's trajectories on the rollout servers, each server replaying its
share on the simulator's own server model (areal_libra/sim/server.py: continuous batching, at most 256 running,
KV-capacity admission and preemption; no noise). Training time is `HardwareTruth.train_step_s` of the step's
sequences on the training layout. "KV binds" says whether a server's KV pool holds fewer L-token sequences than
it is given (then it runs them in waves or preempts).
"""

from __future__ import annotations

import argparse
import json
import sys

from areal_libra.sim.hardware import TRUTH_PROFILES, HardwareTruth, truth_constants, truth_from_specs
from areal_libra.trace import Segment, Trajectory
from areal_libra.utils import first_line

LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
PAPER_BATCH = 2048  # trajectories a step: 128 prompts x 16 samples
MAX_RUNNING = 256  # the simulator's engine limit (RunConfig.max_running)
PAPER = {"rollout": 95.0, "train": 3.9}


def rollout_s(truth: HardwareTruth, tp: int, servers: int, n_traj: int, length: int, prompt: int) -> dict:
    """Makespan of `n_traj` one-turn trajectories of `length` tokens spread evenly over `servers` TP-`tp` servers."""
    from evaluation.sim_bench import replay_on_server

    per = -(-n_traj // servers)  # the busiest server sets the step
    trajs = [Trajectory(f"g{i}", f"p{i}", 0, prompt, (Segment(length - prompt, None),)) for i in range(per)]
    run = replay_on_server(truth, tp, trajs, concurrency=MAX_RUNNING, noise=False)
    fits = truth.kv_capacity_tokens(tp) // length
    return {"seconds": run.seconds, "per_server": per, "kv_fits": fits,
            "kv_binds": fits < min(per, MAX_RUNNING), "preemptions": run.preemptions}


def growth(truth: HardwareTruth, rollout_gpus: int, rollout_tp: int, train_gpus: int, train_tp: int,
           prompt: int, lengths=LENGTHS) -> dict:
    servers = rollout_gpus // rollout_tp
    dp = train_gpus // train_tp
    if servers < 1 or dp < 1:
        raise ValueError("--rollout-gpus must be >= --rollout-tp and --train-gpus >= --train-tp")
    if not truth.train_memory_ok(train_tp, 1, dp):
        raise ValueError(f"TP{train_tp} x DP{dp} does not hold the model's training state")
    if prompt < 1 or prompt >= min(lengths):
        raise ValueError(f"--prompt-tokens must be in 1..{min(lengths) - 1}")
    rows = []
    step_tokens = PAPER_BATCH * min(lengths)
    for length in lengths:
        row: dict = {"length": length}
        for mode, n in (("batch", PAPER_BATCH), ("tokens", max(1, step_tokens // length))):
            r = rollout_s(truth, rollout_tp, servers, n, length, prompt)
            row[mode] = {"trajectories": n, "rollout_s": r["seconds"], "per_server": r["per_server"],
                         "kv_fits_per_server": r["kv_fits"], "kv_binds": r["kv_binds"],
                         "preemptions": r["preemptions"],
                         "train_s": truth.train_step_s([length] * n, train_tp, 1, dp, n // dp or 1)}
        one = rollout_s(truth, rollout_tp, 1, 1, length, prompt)
        row["one_request_s"] = one["seconds"]
        rows.append(row)
    first, last = rows[0], rows[-1]
    ratios = {mode: {"rollout": last[mode]["rollout_s"] / first[mode]["rollout_s"],
                     "train": last[mode]["train_s"] / first[mode]["train_s"]} for mode in ("batch", "tokens")}
    ratios["one_request"] = {"rollout": last["one_request_s"] / first["one_request_s"]}
    return {"rows": rows, "ratios": ratios, "paper": PAPER, "rollout_servers": servers, "rollout_tp": rollout_tp,
            "train_layout": f"TP{train_tp} x DP{dp}", "train_gpus": train_gpus, "rollout_gpus": rollout_gpus,
            "prompt_tokens": prompt, "kv_capacity_tokens_per_server": truth.kv_capacity_tokens(rollout_tp)}


def render(g: dict) -> str:
    out = [f"rollout: {g['rollout_servers']} x TP{g['rollout_tp']} servers ({g['rollout_gpus']} GPUs, "
           f"{g['kv_capacity_tokens_per_server']:,} KV tokens each); training: {g['train_layout']} "
           f"({g['train_gpus']} GPUs); prompt {g['prompt_tokens']} tokens",
           "| length | batch fixed (2,048): rollout s | train s | KV binds (fits/given per server) "
           "| tokens fixed (2,048 x 1K): trajectories | rollout s | train s | KV binds | one request: rollout s |",
           "| ---: | ---: | ---: | --- | ---: | ---: | ---: | --- | ---: |"]
    for r in g["rows"]:
        b, t = r["batch"], r["tokens"]
        out.append(f"| {r['length'] // 1024}K | {b['rollout_s']:,.1f} | {b['train_s']:,.1f} | "
                   f"{'yes' if b['kv_binds'] else 'no'} ({b['kv_fits_per_server']}/{b['per_server']}) | "
                   f"{t['trajectories']:,} | {t['rollout_s']:,.1f} | {t['train_s']:,.1f} | "
                   f"{'yes' if t['kv_binds'] else 'no'} ({t['kv_fits_per_server']}/{t['per_server']}) | "
                   f"{r['one_request_s']:,.1f} |")
    ra = g["ratios"]
    out.append(f"| 32K / 1K | {ra['batch']['rollout']:.1f}x | {ra['batch']['train']:.1f}x | | | "
               f"{ra['tokens']['rollout']:.1f}x | {ra['tokens']['train']:.1f}x | | {ra['one_request']['rollout']:.1f}x |")
    out.append(f"| paper | {g['paper']['rollout']:.0f}x | {g['paper']['train']}x | | | "
               f"{g['paper']['rollout']:.0f}x | {g['paper']['train']}x | | |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default="a800x48")
    ap.add_argument("--model", default="qwen3-14b")
    ap.add_argument("--truth", default="default", choices=sorted(TRUTH_PROFILES))
    ap.add_argument("--rollout-gpus", type=int, default=16)
    ap.add_argument("--rollout-tp", type=int, default=2)
    ap.add_argument("--train-gpus", type=int, default=32)
    ap.add_argument("--train-tp", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        from areal_libra.cost.presets import load_cluster, load_model

        cl, md = load_cluster(args.cluster), load_model(args.model)
        if args.rollout_gpus + args.train_gpus > cl.n_gpus:
            raise ValueError(f"--rollout-gpus + --train-gpus exceed the cluster's {cl.n_gpus} GPUs")
        truth = truth_from_specs(cl.hardware, md, truth_constants(args.truth))
        g = growth(truth, args.rollout_gpus, args.rollout_tp, args.train_gpus, args.train_tp, args.prompt_tokens)
    except (ValueError, OSError, KeyError) as e:
        print(f"error: {first_line(e)}", file=sys.stderr)
        return 2
    g.update(cluster=args.cluster, model=args.model, truth=args.truth)
    print(json.dumps(g, indent=1) if args.json else render(g))
    return 0


if __name__ == "__main__":
    sys.exit(main())
