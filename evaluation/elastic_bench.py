"""Elastic Hybrid Pool benchmark on loopback gloo (pinned --json keys, issue 6).

    python evaluation/elastic_bench.py [--model qwen2|mlp] [--hidden N] [--batch N] [--repeats R]
        [--join-at S] [--release-after K] [--fetch-delay SEC] [--pin-cpus] [--background-nice N] [--json]

Per repeat, three runs of the same deterministic training (tests.rigs.elastic_bed):
  joined  one core replica; hybrid h0 is asked to join at --join-at and released --release-after steps
          after its first real gradient;
  ref_a   the same steps with no hybrid (also the step-time baseline);
  ref_a2  the same as ref_a again (A/A: the noise the machine alone puts into a step-time ratio);
  ref_b   from ref_a's state at h0's activation step, h0 a static member, up to the release.
Reported:
  equivalence_max_abs_diff  max |joined - ref_a| over steps up to activation and |joined - ref_b| from
                            activation to release (fp32 parameters);
  core_step_s_no_join       median core step time of ref_a over the steps the join spanned in `joined`;
  core_step_s_during_join   median core step time of `joined` over those steps (request .. first real
                            gradient: requested, fetching, zero-sync, activating);
  join_latency_s            request -> first committed step with the replica's real gradients (median);
  release_latency_s         request -> its rollout server serving again with current weights (median).
Without --json it also prints, per repeat, the during-join median over (a) the same steps of ref_a and
(b) the steps before the request in the same run (same ambient load), their spread over repeats, and
where the training thread spent its protocol time in each join step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

# c10d logs a warning for every store wait slice that runs out (long steps); keep the output readable.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
# The measurements in the README were taken with forked bed processes (they inherit the imported model code).
os.environ.setdefault("ELASTIC_TB_START", "fork")

from areal_libra.elastic_runtime.core import RuntimeConfig
from tests.rigs.elastic_bed import TestbedConfig, equivalence_references, run

KEYS = ("equivalence_max_abs_diff", "core_step_s_no_join", "core_step_s_during_join", "join_latency_s",
        "release_latency_s")
JOINING = ("elastic/n_requested", "elastic/n_fetching", "elastic/n_zero_sync", "elastic/n_activating")


class UsageError(ValueError):
    pass


def _maxdiff(a, b) -> float:
    return float((a - b).abs().max())


def one_repeat(args: argparse.Namespace, workdir: str, seed: int) -> dict[str, object]:
    rt = RuntimeConfig(fetch_delay_s=args.fetch_delay)
    base = dict(model=args.model, hidden=args.hidden, batch_per_rank=args.batch, seed=seed, runtime=rt,
                lr=args.lr, pin_cpus=args.pin_cpus, background_nice=args.background_nice)
    joined_res = run(TestbedConfig(max_steps=args.max_steps, join_at={"h0": args.join_at},
                                   release_after={"h0": args.release_after}, tail_steps=args.tail, **base),
                     f"{workdir}/joined")
    joined = joined_res["core"][0]
    hyb = joined_res["hybrids"]["h0"][0] or {}
    if "h0" not in joined["first_real"]:
        raise RuntimeError(f"h0 never activated within {args.max_steps} steps; events: {joined['events']}")
    a = joined["first_real"]["h0"]
    n = joined["final_step"]
    released = [m["step"] for m in joined["metrics"] if "h0" not in m["members"] and m["step"] > a]
    r = released[0] if released else n  # first step without h0: params[r] is the last one it shaped
    # ref_a: no join; ref_b: h0 static from a (same helper as the tests; a reference that lost h0 raises).
    ref_a, ref_b = equivalence_references(TestbedConfig(**base), a, n, workdir, until=r)
    # A/A: a second no-join run, compared with ref_a exactly as `joined` is: the spread that ambient load
    # alone (other processes on the machine) puts into the ratio.
    ref_a2 = run(TestbedConfig(max_steps=n, hybrids=(), **base), f"{workdir}/ref_a2")["core"][0]
    ref_by_step = {m["step"]: m for m in ref_a["metrics"]}
    diff = max([_maxdiff(joined["params"][k], ref_a["params"][k]) for k in range(a + 1)]
               + [_maxdiff(joined["params"][k], ref_b["params"][k]) for k in range(a, r + 1)])
    # "During join" = from the step at which the join is requested up to, not including, the first
    # step with the replica's real gradients: requested, fetching, zero_sync (activating flips to
    # training at a step boundary, so it never lasts a step).
    join_steps = [m["step"] for m in joined["metrics"] if any(m.get(k, 0) > 0 for k in JOINING)]
    # Same-run baseline: the steps before the request (step 0 excluded: first-step warm-up), measured
    # seconds before the join under the same ambient load.
    before = [s for s in joined["step_s"] if 0 < s < args.join_at]
    ev = {e["event"]: e for e in joined["events"]}
    by_step = {m["step"]: m for m in joined["metrics"]}
    phases = []
    for s in join_steps:
        m = by_step[s]
        phases.append({"phase": next((k[10:] for k in JOINING if m.get(k, 0) > 0), "?"),
                       "x_ref": joined["step_s"][s] / ref_a["step_s"][s],
                       "protocol_ms": 1e3 * (m["elastic/begin_s"] + m["elastic/reduce_s"]),
                       "ref_protocol_ms": 1e3 * (ref_by_step[s]["elastic/begin_s"] + ref_by_step[s]["elastic/reduce_s"]),
                       **{k: 1e3 * m[f"elastic/{k}"] for k in ("begin_s", "rebuild_s", "allreduce_s", "fence_s")}})
    during = [joined["step_s"][s] for s in join_steps]
    no_join = [ref_a["step_s"][s] for s in join_steps]
    return {
        "phases": phases,
        "diff": diff,
        "during": during,
        "no_join": no_join,
        "x_ref": statistics.median(during) / statistics.median(no_join),
        "x_ref_mean": statistics.fmean(during) / statistics.fmean(no_join),
        "x_aa": statistics.median(ref_a2["step_s"][s] for s in join_steps) / statistics.median(no_join),
        # CPU time of the training thread itself: the protocol's own work on it (and cache effects),
        # without the time it waited for a CPU.
        "x_cpu": statistics.median(joined["cpu_s"][s] for s in join_steps)
        / statistics.median(ref_a["cpu_s"][s] for s in join_steps),
        # The first step with the replica's real gradients: a training step of two replicas (the core
        # waits for the slower one and all-reduces with it), reported apart from the join.
        "x_first": joined["step_s"][a] / ref_a["step_s"][a],
        "x_before": statistics.median(during) / statistics.median(joined["step_s"][s] for s in before)
        if before else float("nan"),
        "join_latency_s": ev["first_real_gradient"]["latency_s"],
        "release_latency_s": ev["released"]["latency_s"] if "released" in ev else float("nan"),
        "activation_step": a, "release_step": r, "join_steps": join_steps,
        # CPU the join cost outside the training thread: the core's background threads (joined minus
        # ref_a, whole run) and the joiner process from the join command to its first training step.
        "core_bg_cpu_s": (joined["process_cpu_s"] - joined["train_cpu_s"]) - (ref_a["process_cpu_s"] - ref_a["train_cpu_s"]),
        "joiner_cpu_s": (hyb.get("join_cpu_s") or [float("nan")])[0],
        "params": int(joined["params"][0].numel()),
        "all_no_join_median": statistics.median(ref_a["step_s"].values()),
    }


def _spread(xs: list[float]) -> str:
    xs = sorted(xs)
    return f"median {statistics.median(xs):.3f} (min {xs[0]:.3f}, max {xs[-1]:.3f}, n {len(xs)})"


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2", choices=("qwen2", "mlp"))
    # Defaults: the smallest configuration whose core step (~0.2 s, 2 k tokens) is long enough that the
    # join's fixed per-step cost is measured against a step, not against the machine's noise (README).
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--join-at", type=int, default=6)
    p.add_argument("--release-after", type=int, default=3)
    p.add_argument("--tail", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--fetch-delay", type=float, default=0.0, help="extra seconds per snapshot fetch (emulates a big model)")
    p.add_argument("--pin-cpus", action="store_true",
                   help="core on CPU 0, hybrid on the others (a stand-in for separate devices)")
    p.add_argument("--background-nice", type=int, default=10,
                   help="nice value of the background threads (0: same priority as training, for comparison)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    for name in ("hidden", "batch", "repeats", "max_steps"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.background_nice <= 19:
        raise UsageError("--background-nice must be in 0..19")
    if args.join_at < 0 or args.release_after < 1 or args.fetch_delay < 0 or args.lr <= 0:
        raise UsageError("--join-at >= 0, --release-after >= 1, --fetch-delay >= 0 and --lr > 0 are required")
    if args.model == "qwen2" and args.hidden % 4:
        raise UsageError("--hidden must be a multiple of 4 for qwen2 (4 attention heads)")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(sys.argv[1:] if argv is None else argv)
    except UsageError as e:
        print(f"elastic_bench: {e}", file=sys.stderr)
        return 2
    if args.model == "qwen2":
        import transformers  # noqa: F401 - imported once here; forked workers inherit it
    reps = []
    with tempfile.TemporaryDirectory(prefix="elastic_bench_") as tmp:
        for i in range(args.repeats):
            reps.append(one_repeat(args, f"{tmp}/r{i}", seed=i))
    during = [x for r in reps for x in r["during"]]
    no_join = [x for r in reps for x in r["no_join"]]
    out = {
        "equivalence_max_abs_diff": max(r["diff"] for r in reps),
        "core_step_s_no_join": statistics.median(no_join),
        "core_step_s_during_join": statistics.median(during),
        "join_latency_s": statistics.median(r["join_latency_s"] for r in reps),
        "release_latency_s": statistics.median(r["release_latency_s"] for r in reps),
    }
    if args.json:
        print(json.dumps(out))
    else:
        for k in KEYS:
            print(f"{k:28s} {out[k]:.6g}")
        ratio = out["core_step_s_during_join"] / out["core_step_s_no_join"]
        print(f"{'during/no-join step time':28s} {ratio:.3f}  (pooled medians; steps during joins: {len(during)}, "
              f"repeats: {args.repeats}, model: {args.model} hidden {args.hidden}, batch {args.batch})")
        print(f"per repeat, during-join median / same steps of the no-join run: {_spread([r['x_ref'] for r in reps])}")
        print(f"per repeat, during-join mean / same steps of the no-join run: {_spread([r['x_ref_mean'] for r in reps])}")
        print(f"per repeat, A/A: a second no-join run / the no-join run, same steps: {_spread([r['x_aa'] for r in reps])}")
        print(f"per repeat, training-thread CPU time, during-join / no-join: {_spread([r['x_cpu'] for r in reps])}")
        print(f"per repeat, first training step / same step of the no-join run: {_spread([r['x_first'] for r in reps])}")
        print(f"per repeat, during-join median / steps 1..{args.join_at - 1} of the same run: "
              f"{_spread([r['x_before'] for r in reps])}")
        print(f"join latency s: {_spread([r['join_latency_s'] for r in reps])}; "
              f"release latency s: {_spread([r['release_latency_s'] for r in reps])}")
        print(f"join CPU outside the training thread, s: core background threads {_spread([r['core_bg_cpu_s'] for r in reps])}; "
              f"joiner process {_spread([r['joiner_cpu_s'] for r in reps])}; model parameters {reps[0]['params']}")
        by_phase: dict[str, list[dict[str, float]]] = {}
        for r in reps:
            for p in r["phases"]:
                by_phase.setdefault(p["phase"], []).append(p)
        for phase, ps in by_phase.items():
            med = {k: statistics.median(p[k] for p in ps) for k in ("x_ref", "protocol_ms", "ref_protocol_ms",
                                                                  "begin_s", "rebuild_s", "allreduce_s", "fence_s")}
            print(f"phase {phase:10s} n {len(ps):3d}: step x{med['x_ref']:.2f} (median); training-thread protocol "
                  f"{med['protocol_ms']:.1f} ms (no-join {med['ref_protocol_ms']:.1f}): begin {med['begin_s']:.2f}, "
                  f"rendezvous wait {med['rebuild_s']:.2f}, all-reduce {med['allreduce_s']:.2f}, clone fence "
                  f"{med['fence_s']:.2f} ms (medians)")
        for i, r in enumerate(reps):
            print(f"repeat {i}: activation step {r['activation_step']}, release step {r['release_step']}, "
                  f"join steps {r['join_steps']}, median no-join step (all) {r['all_no_join_median']:.4f}s, "
                  f"x_ref {r['x_ref']:.3f}, x_aa {r['x_aa']:.3f}, x_cpu {r['x_cpu']:.3f}, x_before {r['x_before']:.3f}")
            for p in r["phases"]:
                # protocol = time in begin_step + reduce_gradients on the training thread
                print(f"  {p['phase']:10s} step x{p['x_ref']:.2f} of no-join; protocol {p['protocol_ms']:.1f} ms "
                      f"(no-join {p['ref_protocol_ms']:.1f}): begin {p['begin_s']:.1f}, rendezvous wait "
                      f"{p['rebuild_s']:.1f}, all-reduce {p['allreduce_s']:.1f}, clone fence {p['fence_s']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
