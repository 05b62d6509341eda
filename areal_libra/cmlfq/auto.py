"""C-MLFQ `auto` mode: the switches are chosen from the trace itself, once per training step.

At a step boundary the policy hands its visible history (trajectories grouped by step) to `choose`, which
scores a small grid of switch settings by leave-one-step-out validation: for each of the newest
`steps` visible steps, a tree is built from the other ones and the held-out step is replayed through it
(metrics of scheduler/replay.py). Then:

1. MLFQ is scored on the same folds. A setting is eligible when its validated migrated token ratio is
   below MLFQ's; the grid is walked from the fixed defaults and an eligible setting replaces the best so
   far only when its validated decision accuracy is higher by more than MARGIN.
   If no eligible setting validates more accurate than MLFQ, the least migrating setting that does is
   taken instead (accuracy first).
2. Fallback regions: a decision falls in region (depth, overrun) with depth = tool returns so far (3 = 3
   or more) and overrun = the context already exceeds the current bucket. On the winner's own replay, each
   region counts how often its decision and MLFQ's decision from the same current bucket were right; where
   MLFQ's was right more often, MLFQ decides in that region (`CMLFQConfig.mlfq_at`). The composite is
   validated again and kept only if it is at least as accurate and still eligible.
3. If the result is less accurate than MLFQ on the folds (or nothing was eligible), MLFQ decides
   everywhere (`mlfq_at="all"`).

Everything is deterministic: subsamples are picked by a CRC of the prompt id (GRPO groups stay whole), the
grid is walked in a fixed order and ties go to the earlier setting.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

from areal_libra.cmlfq.replay import _Acc, decision_points, route_trajectory
from areal_libra.trace import Trajectory

# The switches auto chooses; the grid is the product of these values (a pinned switch keeps its value).
TREE_GRID: dict[str, tuple] = {"state_key": ("tool,size,status", ""), "drift": (False, True), "window": (200, 50)}
# (No move-cost switch: whether a move pays for its re-prefill is priced by the Cost Evaluator, not tuned.)
RULE_GRID: dict[str, tuple] = {"center": (0.3, 0.5, None), "overrun": (False, True), "growth": (0.0, 0.5)}
TUNED = tuple(TREE_GRID) + tuple(RULE_GRID)
MIGRATION_CAP = 0.9  # eligible: validated migrated token ratio < this x MLFQ's (or none migrated): a margin, as
# validation runs on other steps than the ones routed next
MARGIN = 0.003  # a setting replaces the best so far only if it validates this much more accurate
TOP_RULES = 4  # rule settings carried into the second stage
REGION_MIN = 20  # decisions a region needs before MLFQ may take it over
ALL_REGIONS = frozenset([(0, False)] + [(d, o) for d in (1, 2, 3) for o in (False, True)])


def parse_regions(text: str) -> frozenset[tuple[int, bool]]:
    """`mlfq_at` text -> regions: "all", or tokens separated by "/" or spaces, each a depth 0-3 with an
    optional "o" (the context overruns the current bucket), e.g. "0/2o/3o"."""
    text = (text or "").strip()
    if text == "all":
        return ALL_REGIONS
    out = set()
    for tok in text.replace("/", " ").split():
        over = tok.endswith("o")
        d = tok[:-1] if over else tok
        if d not in ("0", "1", "2", "3") or (d == "0" and over):
            raise ValueError(f"mlfq_at: bad region {tok!r} (depth 0-3, optional 'o' from depth 1)")
        out.add((int(d), over))
    return frozenset(out)


def format_regions(regions: frozenset[tuple[int, bool]]) -> str:
    if regions == ALL_REGIONS:
        return "all"
    return "/".join(f"{d}{'o' if o else ''}" for d, o in sorted(regions))


@dataclass
class AutoChoice:
    switches: dict  # the chosen values of TUNED
    mlfq_at: str  # regions where MLFQ decides ("all": MLFQ everywhere)
    accuracy: float  # validated decision accuracy of the choice
    migrated: float  # validated migrated token ratio
    mlfq_accuracy: float
    mlfq_migrated: float
    folds: int
    steps: list[int] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"switches": dict(self.switches), "mlfq_at": self.mlfq_at, "accuracy": self.accuracy,
                "migrated": self.migrated, "mlfq_accuracy": self.mlfq_accuracy,
                "mlfq_migrated": self.mlfq_migrated, "folds": self.folds, "steps": list(self.steps)}

    def describe(self) -> str:
        sw = ",".join(f"{k}={'none' if v is None else v}" for k, v in self.switches.items())
        return (f"{sw},mlfq_at={self.mlfq_at or '-'} (validated on {self.folds} folds: acc {self.accuracy:.4f} "
                f"mig {self.migrated:.4f}; MLFQ {self.mlfq_accuracy:.4f} / {self.mlfq_migrated:.4f})")


def _crc(s: str) -> int:
    return zlib.crc32(s.encode())


def subsample(trajs: Sequence[Trajectory], cap: int) -> list[Trajectory]:
    """At most ~cap trajectories, whole prompts in CRC order (deterministic, GRPO groups kept together)."""
    if cap <= 0 or len(trajs) <= cap:
        return list(trajs)
    by_prompt: dict[str, list[Trajectory]] = {}
    for t in trajs:
        by_prompt.setdefault(t.prompt_id, []).append(t)
    out: list[Trajectory] = []
    for pid in sorted(by_prompt, key=lambda p: (_crc(p), p)):
        if len(out) >= cap:
            break
        out.extend(by_prompt[pid])
    return out


def folds(history: dict[int, list[Trajectory]], steps: int) -> list[tuple[list[Trajectory], list[Trajectory]]]:
    """(train, held-out) pairs: leave one of the newest `steps` visible steps out; with a single visible
    step, its prompts are split in two halves by CRC instead."""
    keys = sorted(k for k, v in history.items() if v)[-steps:]
    if not keys:
        return []
    if len(keys) == 1:
        trajs = history[keys[0]]
        halves: tuple[list[Trajectory], list[Trajectory]] = ([], [])
        for t in trajs:
            halves[_crc(t.prompt_id) % 2].append(t)
        if not halves[0] or not halves[1]:
            return []
        return [(halves[1], halves[0]), (halves[0], halves[1])]
    return [([t for k in keys if k != s for t in history[k]], history[s]) for s in keys]


class _Fold:
    """One fold: the held-out decision points, and the candidate trees built from its training part."""

    def __init__(self, buckets: tuple[int, ...], base, train: list[Trajectory], held: list[Trajectory],
                 cmlfq_cls: type, pricer=None):
        self.buckets, self.base, self.train, self.pricer, self.cmlfq_cls = buckets, base, train, pricer, cmlfq_cls
        self.cases = [(t, decision_points(t)) for t in held]
        self._trees: dict[tuple, object] = {}

    def policy(self, tree_sw: dict):
        key = tuple(sorted(tree_sw.items()))
        pol = self._trees.get(key)
        if pol is None:
            # growth > 0 while building so that the growth table exists; its exponent is set per rule.
            cfg = replace(self.base, auto=False, mlfq_at="", growth=0.5, tree_path=None, fallback=False, **tree_sw)
            pol = self.cmlfq_cls(self.buckets, cfg, pricer=self.pricer)
            pol.fit(self.train)
            if pol.drift is not None:
                pol.drift.past_ok = True  # a held-out step may lie before the training steps
                pol._install_rule()  # (the core holds the drift state)
            pol._auto_growth = pol.growth  # kept aside while a rule without growth is scored (faster path)
            self._trees[key] = pol
        return pol


def _set_rule(pol, rule_sw: dict, mlfq_at: str) -> None:
    for k, v in rule_sw.items():
        setattr(pol.config, k, v)
    pol.growth = pol._auto_growth if pol.config.growth else None
    pol.config.mlfq_at = mlfq_at
    pol._mlfq_at = parse_regions(mlfq_at)
    pol._install_rule()


def _score(pol, fold: _Fold, regions: dict | None = None) -> _Acc:
    """Replay the held-out step through `pol` (no learning); regions[(depth, overrun)] accumulates
    [policy right, MLFQ's decision from the same current bucket right, decisions]."""
    acc = _Acc()
    th = pol.buckets
    for traj, points in fold.cases:
        obs = None
        if regions is not None:
            oracle = pol.bucket_of(traj.final_length)

            def obs(req, current, new, oracle=oracle):
                if current is None:  # the start: MLFQ places everything in the shortest bucket
                    key, m = (0, False), 0
                else:
                    over = req.context_tokens > th[current]
                    key = (min(len(req.tool_returns), 3), over)
                    m = max(current, pol.bucket_of(req.context_tokens)) if over else current
                r = regions.setdefault(key, [0, 0, 0])
                r[0] += new == oracle
                r[1] += m == oracle
                r[2] += 1
        route_trajectory(pol, traj, acc, False, points=points, observe=obs)
    return acc


def _metrics(accs: list[_Acc]) -> tuple[float, float]:
    dec = sum(a.decisions for a in accs)
    fin = sum(a.final_tokens for a in accs)
    return (sum(a.correct for a in accs) / dec if dec else 0.0,
            sum(a.moved_tokens for a in accs) / fin if fin else 0.0)


def _grid(grid: dict[str, tuple], pinned: dict) -> list[dict]:
    out: list[dict] = [{}]
    for k, vals in grid.items():
        vals = (pinned[k],) if k in pinned else vals
        out = [{**c, k: v} for c in out for v in vals]
    return out


def choose(history: dict[int, list[Trajectory]], buckets: Sequence[int], base, cmlfq_cls: type, mlfq_cls: type,
           pinned: dict | None = None, steps: int = 3, sample: int = 192, train_cap: int = 512,
           pricer=None) -> AutoChoice | None:
    """Pick the switches for the next step (module docstring). `base`: the policy's CMLFQConfig (its
    untuned fields are kept); `cmlfq_cls`, `mlfq_cls`: the policy classes whose candidates are replayed
    (policy.CMLFQPolicy, policy.MLFQPolicy: passed in, the policy module imports this one); `pinned`:
    switches the caller fixed; `pricer`: the policy's migration price (the candidates are validated with
    it). None when nothing can be validated.

    The grid is walked in two stages to stay cheap: every rule setting (RULE_GRID) on the first tree of
    TREE_GRID; then the TOP_RULES best rules on each other value of the tree switches (state_key, drift,
    window), one switch at a time from the best tree so far."""
    pinned = pinned or {}
    pairs = folds(history, steps)
    if not pairs:
        return None
    th = tuple(buckets)
    fs = [_Fold(th, base, subsample(tr, train_cap * max(1, len(pairs) - 1)), subsample(ho, sample), cmlfq_cls, pricer)
          for tr, ho in pairs]
    m_acc, m_mig = _metrics([_score(mlfq_cls(th), f) for f in fs])
    cap = MIGRATION_CAP * m_mig
    seen: dict[tuple, tuple[float, float]] = {}

    def evaluate(tree_sw: dict, rule_sw: dict, regions: str = "") -> tuple[float, float]:
        key = (tuple(tree_sw.items()), tuple(rule_sw.items()), regions)
        if key not in seen:
            accs = []
            for f in fs:
                pol = f.policy(tree_sw)
                _set_rule(pol, rule_sw, regions)
                accs.append(_score(pol, f))
            seen[key] = _metrics(accs)
        return seen[key]

    def better(a: tuple[float, float], b: tuple[float, float] | None) -> bool:
        # The grid starts at the fixed defaults: another setting must beat the best so far by MARGIN (the
        # folds are small; the best of many noisy scores is optimistic).
        return (a[1] < cap or a[1] == 0) and (b is None or a[0] > b[0] + MARGIN)

    tree0 = {k: pinned.get(k, v[0]) for k, v in TREE_GRID.items()}
    rules = _grid(RULE_GRID, pinned)
    best = None  # (metrics, tree switches, rule switches)
    ranked: list[tuple[tuple[float, float], int]] = []
    for i, rule_sw in enumerate(rules):
        m = evaluate(tree0, rule_sw)
        ranked.append((m, i))
        if better(m, best[0] if best else None):
            best = (m, tree0, rule_sw)
    # Stage 2: the best rules (eligible first, then by accuracy) on each other tree, one switch at a time.
    ranked.sort(key=lambda x: (x[0][1] >= cap and x[0][1] > 0, -x[0][0], x[0][1], x[1]))
    top = [rules[i] for _, i in ranked[:TOP_RULES]]
    for k in (k for k in TREE_GRID if k not in pinned):
        tree_best = best[1] if best else tree0
        for v in TREE_GRID[k]:
            if v == tree_best[k]:
                continue
            for rule_sw in top:
                m = evaluate({**tree_best, k: v}, rule_sw)
                if better(m, best[0] if best else None):
                    best = (m, {**tree_best, k: v}, rule_sw)
    if best is None or best[0][0] < m_acc + MARGIN:
        # No setting migrates less than MLFQ and is more accurate: accuracy comes first, so take the least
        # migrating setting that validates more accurate than MLFQ (grid order on ties).
        alt = [(m[1], n, (dict(k[0]), dict(k[1]))) for n, (k, m) in enumerate(seen.items())
               if not k[2] and m[0] >= m_acc + MARGIN]
        if alt:
            mg_, _, (tree_sw, rule_sw) = min(alt, key=lambda x: x[:2])
            best = (seen[(tuple(tree_sw.items()), tuple(rule_sw.items()), "")], tree_sw, rule_sw)
            cap = max(cap, mg_ * 1.0001)  # the region fallback below must not migrate more than this
    used = sorted(k for k, v in history.items() if v)[-steps:]

    def result(sw: dict, regions: str, a: float, mg: float) -> AutoChoice:
        return AutoChoice({k: sw[k] for k in TUNED}, regions, a, mg, m_acc, m_mig, len(fs), used)

    if best is None:
        defaults = {f.name: getattr(base, f.name) for f in fields(base) if f.name in TUNED}
        return result(defaults, "all", m_acc, m_mig)
    (a, mg), tree_sw, rule_sw = best
    regions: dict = {}
    for f in fs:
        pol = f.policy(tree_sw)
        _set_rule(pol, rule_sw, "")
        _score(pol, f, regions)
    worse = frozenset(k for k, (ok, mok, n) in regions.items() if n >= REGION_MIN and mok > ok)
    chosen = ""
    if worse:
        text = format_regions(worse)
        ca, cm = evaluate(tree_sw, rule_sw, text)
        if ca >= a and (cm < cap or cm == 0):
            a, mg, chosen = ca, cm, text
    if a < m_acc:
        return result({**tree_sw, **rule_sw}, "all", m_acc, m_mig)
    return result({**tree_sw, **rule_sw}, chosen, a, mg)
