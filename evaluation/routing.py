"""Score C-MLFQ and its baselines on trajectory traces (pinned CLI, issue 4).

    python evaluation/routing.py --train FILES --eval FILES --buckets T1,T2,T3 \
        [--policies cmlfq,mlfq,predictor,oracle] [--cmlfq key=val,...] [--variant NAME:key=val,...] [--json]
        [--auto-log]

Builds the prefix tree (and trains the predictor) from --train, then replays --eval step by step under
the visibility rule of docs/trace-format.md: a trajectory sees the training traces and the
evaluated trajectories of earlier steps, never those of its own step. Prints, per policy, the metrics
defined there. --cmlfq sets the switches of the cmlfq row; --variant adds a C-MLFQ row with other switches (CMLFQConfig fields), e.g.
`--variant paper:center=none,start_lookup=false`. C-MLFQ runs in auto mode unless a tuned switch is set (or
auto=false); --auto-log prints what it chose at each step boundary. Moves are not priced here (a replay of
lengths has no servers; the simulator and the live router price them, docs/cmlfq.md).
"""

from __future__ import annotations

import argparse
import json
import sys

from areal_libra.cmlfq import POLICIES, CMLFQConfig, make_policy
from areal_libra.cmlfq.replay import replay
from areal_libra.trace import TraceError, read_traces

METRICS = ("decision_accuracy", "token_accuracy", "migrated_token_ratio", "migrations_per_trajectory")
DEFAULT_POLICIES = "cmlfq,mlfq,predictor,oracle,round_robin,least_loaded"


class UsageError(ValueError):
    pass


def _files(values: list[str]) -> list[str]:
    out = [p for v in values for p in v.split(",") if p]
    if not out:
        raise UsageError("no trace files given")
    return out


def parse_buckets(text: str) -> list[int]:
    try:
        th = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--buckets must be comma-separated integers, got {text!r}") from None
    if not th or any(t <= 0 for t in th) or th != sorted(set(th)):
        raise UsageError(f"--buckets must be strictly ascending positive thresholds, got {text!r}")
    return th


def _value(text: str):
    low = text.lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_variant(text: str) -> tuple[str, dict]:
    name, sep, rest = text.partition(":")
    if not sep or not name:
        raise UsageError(f"--variant must look like NAME:key=value,..., got {text!r}")
    switches = {}
    for item in filter(None, rest.split(",")):
        key, eq, val = item.partition("=")
        if not eq or not hasattr(CMLFQConfig, key) or key == "tree_path":
            raise UsageError(f"--variant {name}: unknown cmlfq switch {key!r}")
        switches[key] = _value(val)
    return name, switches


def depth_context_reference(train, evals, buckets: list[int], ctx_bin: int = 128) -> float:
    """Decision accuracy of a static table (tool returns so far, context // ctx_bin) -> majority oracle
    bucket, learned on the training traces: a rough bound for any policy that sees only depth and context
    (no per-prompt history, no tool states)."""
    import bisect
    from collections import Counter, defaultdict

    from areal_libra.cmlfq import decision_contexts

    last = len(buckets) - 1
    table: dict = defaultdict(Counter)
    for t in train:
        o = min(bisect.bisect_left(buckets, t.final_length), last)
        for k, c in enumerate(decision_contexts(t)):
            table[(k, c // ctx_bin)][o] += 1
    ok = n = 0
    for t in evals:
        o = min(bisect.bisect_left(buckets, t.final_length), last)
        for k, c in enumerate(decision_contexts(t)):
            cnt = table.get((k, c // ctx_bin))
            guess = cnt.most_common(1)[0][0] if cnt else min(bisect.bisect_left(buckets, c), last)
            ok += guess == o
            n += 1
    return ok / n if n else 0.0


def start_references(train, evals, buckets: list[int]) -> tuple[float, float]:
    """Accuracy of start placements by the majority bucket of the prompt's other samples: (a) in the same
    step, leave-one-out — not causal, what perfectly fresh per-prompt history could give; (b) in earlier
    steps (training files and already-scored evaluation steps) — what a causal policy can use. Starts of
    prompts without such samples fall back to the overall majority bucket."""
    import bisect
    from collections import Counter, defaultdict

    last = len(buckets) - 1

    def bucket(t) -> int:
        return min(bisect.bisect_left(buckets, t.final_length), last)

    overall = Counter(bucket(t) for t in train).most_common(1)
    default = overall[0][0] if overall else 0
    same: dict = defaultdict(Counter)
    for t in evals:
        same[(t.prompt_id, t.step)][bucket(t)] += 1
    earlier: dict = defaultdict(Counter)
    for t in train:
        earlier[t.prompt_id][bucket(t)] += 1
    by_step: dict = defaultdict(list)
    for t in evals:
        by_step[t.step].append(t)
    fresh = causal = 0
    for step in sorted(by_step):
        for t in by_step[step]:
            o = bucket(t)
            loo = same[(t.prompt_id, step)].copy()
            loo[o] -= 1
            loo = +loo  # drop the emptied count
            fresh += (loo.most_common(1)[0][0] if loo else default) == o
            hist = earlier.get(t.prompt_id)
            causal += (hist.most_common(1)[0][0] if hist else default) == o
        for t in by_step[step]:
            earlier[t.prompt_id][bucket(t)] += 1
    n = len(evals)
    return (fresh / n, causal / n) if n else (0.0, 0.0)


def parse_price(text: str, n_buckets: int):
    """--price CLUSTER:MODEL:TP,TP,... (cost presets and one TP per bucket) -> a MigrationPricer."""
    from areal_libra.cmlfq import MigrationPricer
    from areal_libra.cost import PresetError, load_cluster, load_model

    parts = text.split(":")
    if len(parts) != 3:
        raise UsageError(f"--price {text!r}: expected CLUSTER:MODEL:TP,TP,... (e.g. a800x48:qwen3-14b:1,2,4)")
    try:
        tps = [int(t) for t in parts[2].split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"--price {text!r}: the TPs must be integers") from None
    if len(tps) != n_buckets:
        raise UsageError(f"--price {text!r}: {len(tps)} TPs for {n_buckets} buckets")
    try:
        return MigrationPricer(load_cluster(parts[0]).hardware, load_model(parts[1]), tps)
    except (PresetError, OSError) as e:
        raise UsageError(f"--price {text!r}: {e}") from None


def evaluate(train, evals, buckets: list[int], policies: list[tuple[str, str, dict]],
             auto_log: dict | None = None, pricer=None) -> dict:
    """Metrics per row; auto_log (if given) receives, per C-MLFQ row in auto mode, every choice it made
    (the first at the end of --train, then one after each scored step; the last one is never used).
    pricer: C-MLFQ's migration price (--price); None: moves are not priced."""
    out = {}
    for label, name, switches in policies:
        pol = make_policy(name, buckets, **switches, **({"pricer": pricer} if name == "cmlfq" else {}))
        pol.fit(train)
        m = replay(pol, evals)
        out[label] = {k: getattr(m, k) for k in METRICS}
        if auto_log is not None and getattr(pol, "auto", False):
            auto_log[label] = list(pol.auto_log)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train", nargs="+", required=True, help="trace files to build from (space or comma separated)")
    ap.add_argument("--eval", nargs="+", required=True, help="trace files to replay and score")
    ap.add_argument("--buckets", required=True, help="ascending final-length thresholds, e.g. 1536,3072,7168")
    ap.add_argument("--policies", default=DEFAULT_POLICIES, help=f"comma-separated, from {','.join(POLICIES)}")
    ap.add_argument("--cmlfq", default="", help="switches of the cmlfq row, key=value,... (CMLFQConfig fields)")
    ap.add_argument("--variant", action="append", default=[], help="extra C-MLFQ row NAME:key=value,...")
    ap.add_argument("--skip-bad", action="store_true", help="skip malformed trace lines (counted on stderr)")
    ap.add_argument("--price", default="", metavar="CLUSTER:MODEL:TP,...",
                    help="price C-MLFQ's moves with the Cost Evaluator for servers of these TPs (one per bucket; "
                         "no load in a replay: a balanced, busy fleet), e.g. a800x48:qwen3-14b:1,2,4")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--auto-log", action="store_true",
                    help="also print what C-MLFQ's auto mode chose at each step boundary (JSON: key 'auto')")
    ap.add_argument("--reference", action="store_true",
                    help="also print reference accuracies: the (depth, context) majority table and start placements by "
                         "the prompt's sibling majority (text output only)")
    args = ap.parse_args(argv)
    try:
        buckets = parse_buckets(args.buckets)
        names = [p.strip() for p in args.policies.split(",") if p.strip()]
        for n in names:
            if n not in POLICIES:
                raise UsageError(f"unknown policy {n!r}; choose from {', '.join(POLICIES)}")
        own = parse_variant(f"cmlfq:{args.cmlfq}")[1]
        rows = [(n, n, own if n == "cmlfq" else {}) for n in names]
        rows += [(v[0], "cmlfq", v[1]) for v in map(parse_variant, args.variant)]
        stats: dict = {}
        train = read_traces(_files(args.train), skip_bad=args.skip_bad, stats=stats)
        evals = read_traces(_files(args.eval), skip_bad=args.skip_bad, stats=stats)
        if not evals:
            raise UsageError("the --eval files hold no trajectories")
        if stats.get("bad_lines"):
            print(f"routing: skipped {stats['bad_lines']} malformed trace lines", file=sys.stderr)
        chosen: dict | None = {} if args.auto_log else None
        pricer = parse_price(args.price, len(buckets)) if args.price else None
        result = evaluate(train, evals, buckets, rows, chosen, pricer)
    except (UsageError, TraceError, ValueError) as e:
        print(f"routing: {e}", file=sys.stderr)
        return 2
    if args.json:
        out = {"policies": result, "n_trajectories": len(evals)}
        if chosen is not None:
            out["auto"] = {k: [c.as_dict() for c in v] for k, v in chosen.items()}
        print(json.dumps(out))
        return 0
    print(f"{len(evals)} trajectories evaluated ({len(train)} for training), buckets {args.buckets}")
    print(f"{'policy':<16}" + "".join(f"{m:>{len(m) + 3}}" for m in METRICS))
    for label, m in result.items():
        print(f"{label:<16}" + "".join(f"{m[k]:>{len(k) + 3}.4f}" for k in METRICS))
    for label, choices in (chosen or {}).items():
        for c in choices:
            print(f"auto {label}, chosen on visible steps {c.steps}: {c.describe()}")
    if args.reference:
        ref = depth_context_reference(train, evals, buckets)
        print(f"reference: a (tool returns so far, context/128) -> majority bucket table from --train scores "
              f"decision_accuracy {ref:.4f}")
        fresh, causal = start_references(train, evals, buckets)
        print(f"reference: start placements by the majority bucket of the prompt's other samples: same step "
              f"(leave-one-out, not causal) {fresh:.4f}, earlier steps {causal:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
