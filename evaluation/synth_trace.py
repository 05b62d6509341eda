"""Synthetic agentic trajectory traces in the canonical format (docs/trace-format.md).

    python evaluation/synth_trace.py --out DIR [--steps 10] [--seed 0] [--set key=value ...] [--growth G]

writes DIR/step_{i}.jsonl.gz (`--measure FILE...` instead prints the persistence() statistic of traces).
`--growth G` sets gen_drift = calls_drift to the smallest multiple of GROWTH_RESOLUTION whose traces grow
by at least G (length_growth(): mean generated tokens per trajectory, last GROWTH_WINDOW steps over the
first GROWTH_WINDOW), every other field at its default; it prints the drift it chose and the growth.
The generative model (every knob is a SynthConfig field, settable with --set) is a task model of a
tool-using agent, written without reference to any routing policy:

- prompts: a pool of `n_prompts`; each has a prompt length, a difficulty d ~ LogNormal(0, difficulty_sigma),
  a main tool (search / python / bash by `tool_weights`), a failure rate base_fail * d^0.5 and a number
  of tool results the task needs, K_p = round(calls_mean * d) (per-prompt difficulty).
- recurring prompts: each step draws `prompts_per_step` prompts, walking the pool epoch by epoch (the pool
  is reshuffled each epoch), `samples_per_prompt` samples each (a GRPO group); a prompt keeps its id.
- a sample needs K = K_p + noise successful calls (noise -1/+1 with probability sample_noise/2 each: the
  policy's own randomness). Each turn is a generation, then a call. A failed or timed-out call makes no
  progress, so the agent retries (tool failure -> retries); after `give_up` failures in a row it gives
  up and answers. A success counts towards K; with probability `explore_prob` the agent makes one more,
  unplanned call (the part of the length nothing foretells); a payload above `large_payload` tokens
  triggers a follow-up call with probability `large_cont` (big outputs such as logs get inspected).
- generation lengths: LogNormal(gen_median * d^0.5 * drift * (1 + prev_payload / payload_gain), gen_sigma)
  (payload size -> longer continuations: the model reads and reasons about what came back), `retry_gen`
  times longer after a failure; the final answer is LogNormal(answer_median * d^0.5 * drift, gen_sigma).
- a call uses the main tool with probability main_tool_prob; it fails with the prompt's failure rate,
  times out with timeout_rate; a success returns LogNormal(tool median * d^0.3, payload_sigma) tokens, a
  failure an error of LogNormal(fail_payload, 0.5), a timeout `timeout_payload` tokens.
- drift over steps: generation lengths grow by gen_drift and the needed calls by calls_drift per step.
- per-sample persistence: each sample draws a verbosity LogNormal(0, sample_gen_sigma) that multiplies all
  its generation medians, and a payload factor LogNormal(0, sample_payload_sigma) that multiplies its
  successful payload medians (a verbose sample stays verbose; a search that returns long passages keeps
  doing so). The defaults make `persistence()` (also `--measure FILES`) match PolyTrace Search-R1 steps
  0-2; 0 and 0 give the first version of this generator, byte for byte.
- a trajectory stops at max_turns or when its context reaches max_context (finish_reason "length").
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from areal_libra.trace import Segment, ToolReturn, Trajectory, write_traces


@dataclass
class SynthConfig:
    n_prompts: int = 128
    prompts_per_step: int = 32
    samples_per_prompt: int = 16  # Libra trains with 16 samples per prompt
    prompt_median: int = 600
    difficulty_sigma: float = 0.5
    tool_weights: dict = field(default_factory=lambda: {"search": 0.5, "python": 0.3, "bash": 0.2})
    tool_payload: dict = field(default_factory=lambda: {"search": 600, "python": 900, "bash": 2500})
    main_tool_prob: float = 0.75
    base_fail: float = 0.12
    timeout_rate: float = 0.03
    fail_payload: int = 150
    timeout_payload: int = 30
    payload_sigma: float = 0.8
    gen_median: int = 250
    answer_median: int = 300
    gen_sigma: float = 0.5
    payload_gain: float = 2000.0
    retry_gen: float = 1.3
    calls_mean: float = 3.0
    sample_noise: float = 0.4
    give_up: int = 3
    explore_prob: float = 0.1
    large_payload: int = 5000
    large_cont: float = 0.3
    gen_drift: float = 0.03
    calls_drift: float = 0.03
    max_turns: int = 30
    max_context: int = 32768
    # Per-sample persistence: a sample's verbosity and the size of what its calls return are shared by its
    # turns (0: every turn independent given the prompt, the first version of this generator). Calibrated
    # so that persistence() matches PolyTrace Search-R1 steps 0-2 (gen 0.27, payload 0.34).
    sample_gen_sigma: float = 0.27
    sample_payload_sigma: float = 0.55


@dataclass(frozen=True)
class _Prompt:
    pid: str
    tokens: int
    difficulty: float
    tool: str
    fail: float
    calls: float


def _lognormal(rng: random.Random, median: float, sigma: float) -> int:
    return max(1, int(round(median * math.exp(rng.gauss(0.0, sigma)))))


def make_prompts(cfg: SynthConfig, rng: random.Random) -> list[_Prompt]:
    names = list(cfg.tool_weights)
    weights = [cfg.tool_weights[n] for n in names]
    out = []
    for i in range(cfg.n_prompts):
        d = math.exp(rng.gauss(0.0, cfg.difficulty_sigma))
        out.append(_Prompt(f"p{i}", min(4096, max(64, _lognormal(rng, cfg.prompt_median, 0.4))), d,
                           rng.choices(names, weights)[0], min(0.6, cfg.base_fail * math.sqrt(d)),
                           cfg.calls_mean * d))
    return out


def make_trajectory(cfg: SynthConfig, p: _Prompt, step: int, tid: str, rng: random.Random) -> Trajectory:
    gen_scale = (1 + cfg.gen_drift) ** step
    u = rng.random()
    noise = -1 if u < cfg.sample_noise / 2 else (1 if u < cfg.sample_noise else 0)
    needed = max(0, round(p.calls * (1 + cfg.calls_drift) ** step) + noise)
    # Drawn only when on, so that sigma 0 reproduces the first version's traces exactly.
    verbose = math.exp(rng.gauss(0.0, cfg.sample_gen_sigma)) if cfg.sample_gen_sigma > 0 else 1.0
    heavy = math.exp(rng.gauss(0.0, cfg.sample_payload_sigma)) if cfg.sample_payload_sigma > 0 else 1.0
    others = [t for t in cfg.tool_payload if t != p.tool] or [p.tool]
    ctx = p.tokens
    segments: list[Segment] = []
    prev_payload, prev_failed, fails_in_row = 0, False, 0
    finish = "stop"
    for _turn in range(cfg.max_turns - 1):
        if needed <= 0 or fails_in_row >= cfg.give_up:
            break
        median = (cfg.gen_median * verbose * math.sqrt(p.difficulty) * gen_scale
                  * (1 + prev_payload / cfg.payload_gain))
        if prev_failed:
            median *= cfg.retry_gen
        gen = _lognormal(rng, median, cfg.gen_sigma)
        if ctx + gen >= cfg.max_context:
            break
        ctx += gen
        tool = p.tool if rng.random() < cfg.main_tool_prob else rng.choice(others)
        u = rng.random()
        if u < p.fail:
            status, payload = "failure", _lognormal(rng, cfg.fail_payload, 0.5)
        elif u < p.fail + cfg.timeout_rate:
            status, payload = "timeout", cfg.timeout_payload
        else:
            status = "success"
            payload = _lognormal(rng, cfg.tool_payload[tool] * heavy * p.difficulty ** 0.3, cfg.payload_sigma)
        payload = min(payload, max(0, cfg.max_context - ctx - 1))
        ctx += payload
        segments.append(Segment(gen, ToolReturn(tool, payload, status, round(rng.uniform(0.05, 2.0), 3))))
        prev_payload, prev_failed = payload, status != "success"
        if prev_failed:
            fails_in_row += 1
            continue
        fails_in_row = 0
        needed -= 1
        if rng.random() < cfg.explore_prob:
            needed += 1
        if payload > cfg.large_payload and rng.random() < cfg.large_cont:
            needed += 1
    answer = _lognormal(rng, cfg.answer_median * verbose * math.sqrt(p.difficulty) * gen_scale
                        * (1 + prev_payload / cfg.payload_gain), cfg.gen_sigma)
    if ctx + answer >= cfg.max_context:
        answer, finish = max(0, cfg.max_context - ctx), "length"
    segments.append(Segment(answer, None))
    return Trajectory(tid, p.pid, step, p.tokens, tuple(segments), finish, None)


def generate(cfg: SynthConfig, steps: int, seed: int = 0) -> list[list[Trajectory]]:
    """Trajectories per step; deterministic in (cfg, steps, seed)."""
    if cfg.prompts_per_step > cfg.n_prompts or cfg.prompts_per_step < 1:
        raise ValueError("prompts_per_step must be between 1 and n_prompts")
    rng = random.Random(seed)
    prompts = make_prompts(cfg, rng)
    order: list[_Prompt] = []
    out = []
    for step in range(steps):
        chosen = []
        while len(chosen) < cfg.prompts_per_step:
            if not order:  # a new epoch over the pool
                order = prompts[:]
                rng.shuffle(order)
            chosen.append(order.pop())
        out.append([make_trajectory(cfg, p, step, f"s{step}-{p.pid}-{k}", rng)
                    for p in chosen for k in range(cfg.samples_per_prompt)])
    return out


def _corr(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    if n < 3:
        return float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else float("nan")


def persistence(trajs: list[Trajectory]) -> dict:
    """Per-sample persistence inside a GRPO group (same prompt, same step), the statistic the
    sample_*_sigma defaults are calibrated on against PolyTrace Search-R1. Over trajectories with >= 3
    segments, log values centred on their group's mean:
    gen: corr(first generation, mean of the later generations);
    payload: corr(first payload, second payload), both calls successful and of the same tool."""
    groups: dict[tuple[str, int], list[Trajectory]] = {}
    for t in trajs:
        if len(t.segments) >= 3 and t.segments[0].tool is not None and t.segments[1].tool is not None:
            groups.setdefault((t.prompt_id, t.step), []).append(t)
    g1: list[float] = []
    g2: list[float] = []
    p1: list[float] = []
    p2: list[float] = []

    def centred(vals: list[float]) -> list[float]:
        m = sum(vals) / len(vals)
        return [v - m for v in vals]

    for ts in groups.values():
        if len(ts) < 3:
            continue
        g1 += centred([math.log1p(t.segments[0].gen_tokens) for t in ts])
        g2 += centred([math.log1p(sum(s.gen_tokens for s in t.segments[1:]) / (len(t.segments) - 1)) for t in ts])
        ok = [t for t in ts if t.segments[0].tool.status == t.segments[1].tool.status == "success"
              and t.segments[0].tool.name == t.segments[1].tool.name]
        if len(ok) >= 3:
            p1 += centred([math.log1p(t.segments[0].tool.payload_tokens) for t in ok])
            p2 += centred([math.log1p(t.segments[1].tool.payload_tokens) for t in ok])
    return {"gen_corr": _corr(g1, g2), "payload_corr": _corr(p1, p2), "gen_pairs": len(g1),
            "payload_pairs": len(p1)}


GROWTH_WINDOW = 5  # steps averaged at each end of the run by length_growth()
GROWTH_RESOLUTION = 0.001  # the drift grid --growth searches
GROWTH_MAX_DRIFT = 0.1  # the largest per-step drift --growth tries


def length_growth(per_step: list[list[Trajectory]], window: int = GROWTH_WINDOW) -> float:
    """How much the trajectories grew over the run: mean generated (model) tokens per trajectory over the
    last `window` steps divided by the same mean over the first `window` steps (whole steps, so one noisy
    step does not decide). Final lengths grow less: the context cap (max_context) cuts the longest."""
    if not per_step:
        return 1.0
    w = max(1, min(window, len(per_step) // 2 or 1))

    def mean(steps: list[list[Trajectory]]) -> float:
        trajs = [t for s in steps for t in s]
        return sum(t.model_tokens for t in trajs) / max(1, len(trajs))

    first = mean(per_step[:w])
    return mean(per_step[-w:]) / first if first > 0 else 1.0


def drift_for_growth(cfg: SynthConfig, steps: int, seed: int, target: float
                     ) -> tuple[float, float, list[list[Trajectory]]]:
    """Smallest drift d on the GROWTH_RESOLUTION grid with length_growth >= target when gen_drift =
    calls_drift = d (the defaults drift both alike), found by bisection: it assumes growth rises with the
    drift (docs/simulator.md checks it point by point for --steps 60 --seed 0). Returns (d, its growth, its
    traces); ValueError when even GROWTH_MAX_DRIFT falls short (e.g. too few steps)."""
    if target <= 1.0:
        raise ValueError(f"--growth must be > 1, got {target}")
    if steps < 2 * GROWTH_WINDOW:
        raise ValueError(f"--growth needs --steps >= {2 * GROWTH_WINDOW} (it compares the first and last "
                         f"{GROWTH_WINDOW} steps)")
    best: list = []  # traces of the smallest passing drift so far (one run's traces kept, not every probe's)

    def passes(k: int) -> bool:
        d = round(k * GROWTH_RESOLUTION, 6)
        per_step = generate(replace(cfg, gen_drift=d, calls_drift=d), steps, seed)
        g = length_growth(per_step)
        if g >= target:
            best[:] = [k, g, per_step]
        return g >= target

    lo, hi = 0, round(GROWTH_MAX_DRIFT / GROWTH_RESOLUTION)  # invariant: lo fails (drift 0: no growth), hi passes
    if not passes(hi):
        raise ValueError(f"--growth {target}: even drift {GROWTH_MAX_DRIFT} does not reach it over {steps} steps")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if passes(mid):
            hi = mid
        else:
            lo = mid
    _, g, per_step = best  # the last passing probe is hi
    return round(hi * GROWTH_RESOLUTION, 6), g, per_step


def _set(cfg: SynthConfig, item: str) -> None:
    key, eq, val = item.partition("=")
    names = {f.name: f for f in fields(SynthConfig)}
    if not eq or key not in names or isinstance(getattr(cfg, key), dict):
        raise ValueError(f"--set: unknown or non-scalar parameter {key!r}")
    cur = getattr(cfg, key)
    try:
        setattr(cfg, key, type(cur)(val))
    except ValueError:
        raise ValueError(f"--set {key}: {val!r} is not a {type(cur).__name__}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="write synthetic agentic traces (canonical format)")
    ap.add_argument("--out", help="output folder (step_{i}.jsonl.gz)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], help="SynthConfig field=value")
    ap.add_argument("--growth", type=float, default=None, metavar="G",
                    help="length growth over the run: picks the smallest gen_drift = calls_drift giving G x "
                         "(mean generated tokens per trajectory, last 5 steps over first 5)")
    ap.add_argument("--measure", nargs="+", metavar="FILE",
                    help="print the per-sample persistence statistic of these trace files and exit")
    args = ap.parse_args(argv)
    cfg = SynthConfig()
    if args.measure:
        from areal_libra.trace import TraceError, read_traces

        try:
            print(persistence(read_traces(args.measure)))
        except (TraceError, OSError) as e:
            print(f"synth_trace: {e}", file=sys.stderr)
            return 2
        return 0
    if not args.out:
        print("synth_trace: --out is required (or --measure FILES)", file=sys.stderr)
        return 2
    try:
        if args.steps < 1:
            raise ValueError("--steps must be >= 1")
        for item in args.set:
            _set(cfg, item)
        if args.growth is not None:
            fixed = [i for i in args.set if i.partition("=")[0] in ("gen_drift", "calls_drift")]
            if fixed:
                raise ValueError(f"--growth picks the drift itself; drop --set {fixed[0]}")
            d, g, per_step = drift_for_growth(cfg, args.steps, args.seed, args.growth)
            print(f"--growth {args.growth:g}: gen_drift = calls_drift = {d:g} gives {g:.2f}x generated tokens "
                  f"per trajectory (steps {args.steps - GROWTH_WINDOW}-{args.steps - 1} over 0-{GROWTH_WINDOW - 1})")
        else:
            per_step = generate(cfg, args.steps, args.seed)
        out = Path(args.out)
        for i, trajs in enumerate(per_step):
            write_traces(out / f"step_{i}.jsonl.gz", trajs)
    except (ValueError, OSError) as e:
        print(f"synth_trace: {e}", file=sys.stderr)
        return 2
    n = sum(len(t) for t in per_step)
    print(f"wrote {n} trajectories in {args.steps} steps to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
