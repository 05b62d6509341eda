"""Routing policies: C-MLFQ and its baselines behind one interface (docs/cmlfq.md).

Buckets are ascending max-length thresholds (bucket i serves final lengths in (T[i-1], T[i]]; lengths
above the last threshold belong to the last bucket). A policy is a deterministic core: the replay
(evaluation/routing.py), the simulator and the live Dispatcher drive the same objects.

Protocol: start(req) -> bucket; tool_return(req, current) -> bucket; finish(traj) feeds what the policy
learns from; end_step() marks a training-step boundary (what "earlier steps" means).
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

from areal_libra.cmlfq.auto import ALL_REGIONS, TREE_GRID, TUNED, AutoChoice, choose, parse_regions
from areal_libra.cmlfq.drift import GrowthTable, LengthDrift
from areal_libra.cmlfq.states import RequestInfo, SizeClasses, ToolState
from areal_libra.cmlfq.tree import PrefixTree, decision_contexts
from areal_libra.trace import Trajectory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Bucket:
    max_len: int
    tp: int = 1


@runtime_checkable
class RoutingPolicy(Protocol):
    buckets: tuple[int, ...]

    def start(self, req: RequestInfo) -> int: ...

    def tool_return(self, req: RequestInfo, current: int) -> int: ...

    def finish(self, traj: Trajectory) -> None: ...


def _check_buckets(buckets: Sequence[int | Bucket]) -> tuple[int, ...]:
    th = tuple(int(b.max_len if isinstance(b, Bucket) else b) for b in buckets)
    if not th or any(t <= 0 for t in th) or list(th) != sorted(set(th)):
        raise ValueError(f"buckets must be strictly ascending positive thresholds, got {list(th)}")
    return th


class _Base:
    name = "base"

    def __init__(self, buckets: Sequence[int | Bucket]) -> None:
        self.buckets = _check_buckets(buckets)
        self._last = len(self.buckets) - 1

    def bucket_of(self, length: float) -> int:
        """Index of the bucket whose range holds `length` (the last bucket for anything longer)."""
        return min(bisect.bisect_left(self.buckets, length), self._last)

    def fit(self, trajs: Iterable[Trajectory]) -> None:
        """Learn from training traces (default: nothing)."""

    def start(self, req: RequestInfo) -> int:
        return 0

    def tool_return(self, req: RequestInfo, current: int) -> int:
        return current

    def finish(self, traj: Trajectory) -> None:
        pass

    def end_step(self) -> None:
        pass


class RoundRobinPolicy(_Base):
    name = "round_robin"

    def __init__(self, buckets: Sequence[int | Bucket]) -> None:
        super().__init__(buckets)
        self._next = 0

    def start(self, req: RequestInfo) -> int:
        b = self._next
        self._next = (self._next + 1) % len(self.buckets)
        return b


class LeastLoadedPolicy(_Base):
    """Places each new trajectory in the bucket with the least load; never moves it. The live Dispatcher
    plugs in real per-group load (load_fn); standalone it counts its own active trajectories."""

    name = "least_loaded"

    def __init__(self, buckets: Sequence[int | Bucket], load_fn: Callable[[], Sequence[float]] | None = None) -> None:
        super().__init__(buckets)
        self.load_fn = load_fn
        self._active: dict[str, int] = {}
        self._count = [0] * len(self.buckets)

    def start(self, req: RequestInfo) -> int:
        loads = list(self.load_fn()) if self.load_fn is not None else self._count
        b = min(range(len(self.buckets)), key=lambda i: (loads[i], i))
        old = self._active.get(req.trajectory_id)
        if old is not None:
            self._count[old] -= 1
        self._active[req.trajectory_id] = b
        self._count[b] += 1
        return b

    def finish(self, traj: Trajectory) -> None:
        b = self._active.pop(traj.trajectory_id, None)
        if b is not None:
            self._count[b] -= 1


class MLFQPolicy(_Base):
    """Classic MLFQ: start in the shortest bucket, demote once the context overruns its threshold."""

    name = "mlfq"

    def tool_return(self, req: RequestInfo, current: int) -> int:
        if req.context_tokens > self.buckets[current]:
            return max(current, self.bucket_of(req.context_tokens))
        return current


class OraclePolicy(_Base):
    """Knows the final length (RequestInfo.final_length): the upper bound of the metrics."""

    name = "oracle"

    def start(self, req: RequestInfo) -> int:
        return 0 if req.final_length is None else self.bucket_of(req.final_length)

    def tool_return(self, req: RequestInfo, current: int) -> int:
        return current if req.final_length is None else self.bucket_of(req.final_length)


class PredictorPolicy(_Base):
    """Length predictor baseline: places a request once, at its start, from what is known then — the
    prompt's length and the final lengths of the prompt's earlier samples (earlier steps) — with a small
    least-squares regressor on those features. It never moves a request afterwards."""

    name = "predictor"

    def __init__(self, buckets: Sequence[int | Bucket], history: int = 64, ridge: float = 1e-3) -> None:
        super().__init__(buckets)
        self.history = history
        self.ridge = ridge
        self._hist: dict[str, deque[int]] = {}
        self._pending: list[Trajectory] = []
        self._seen: deque[Trajectory] = deque(maxlen=20_000)
        self._w: list[float] | None = None
        self._global_mean = 0.0

    def _features(self, prompt_id: str, prompt_tokens: int) -> list[float]:
        h = self._hist.get(prompt_id)
        hm = sum(h) / len(h) if h else self._global_mean
        return [1.0, prompt_tokens / 1000.0, math.log1p(prompt_tokens), hm / 1000.0,
                1.0 if h else 0.0, math.log1p(len(h)) if h else 0.0]

    def fit(self, trajs: Iterable[Trajectory]) -> None:
        for t in sorted(trajs, key=lambda t: t.step):
            self._seen.append(t)
        self._refit()

    def _refit(self) -> None:
        import numpy as np

        rows, ys = [], []
        self._hist = {}
        by_step: dict[int, list[Trajectory]] = {}
        for t in self._seen:
            by_step.setdefault(t.step, []).append(t)
        total, n = 0.0, 0
        # Features of a sample only use earlier steps, exactly what a request sees at run time.
        for step in sorted(by_step):
            self._global_mean = total / n if n else 0.0
            for t in by_step[step]:
                rows.append(self._features(t.prompt_id, t.prompt_tokens))
                ys.append(float(t.final_length))
            for t in by_step[step]:
                self._hist.setdefault(t.prompt_id, deque(maxlen=self.history)).append(t.final_length)
                total += t.final_length
                n += 1
        self._global_mean = total / n if n else 0.0
        if not rows:
            self._w = None
            return
        x = np.asarray(rows)
        y = np.asarray(ys)
        a = x.T @ x + self.ridge * len(rows) * np.eye(x.shape[1])
        self._w = [float(v) for v in np.linalg.solve(a, x.T @ y)]

    def predict(self, prompt_id: str, prompt_tokens: int) -> float:
        if self._w is None:
            return 0.0
        return sum(w * f for w, f in zip(self._w, self._features(prompt_id, prompt_tokens)))

    def start(self, req: RequestInfo) -> int:
        return self.bucket_of(self.predict(req.prompt_id, req.prompt_tokens))

    def finish(self, traj: Trajectory) -> None:
        self._pending.append(traj)

    def end_step(self) -> None:
        if self._pending:
            self._seen.extend(self._pending)
            self._pending = []
            self._refit()


# Fewest scored decisions before the fallback judges C-MLFQ: the standard error of a measured accuracy is at
# most sqrt(0.25 / n), 0.05 at n = 100 (a statistical floor, not a setting fitted to any workload).
FALLBACK_MIN_DECISIONS = 100
# C-MLFQ keeps deciding only while its accuracy exceeds the fallback's by this many standard errors (the
# conventional one-sided ~98% bound): every move and every placement away from the least-loaded bucket costs
# something, so the burden of proof is on C-MLFQ.
FALLBACK_Z = 2.0


class DecisionAccuracy:
    """C-MLFQ's measured decision accuracy over its most recent scored decisions (a decision is right when it
    chose the bucket of the trajectory's final length), against the accuracy its fallback reaches on the
    same trajectories. Least-loaded routing ignores lengths: it fills bucket b with a share q_b of the
    requests (its share of the GPUs, as it balances load per GPU), so it is right with probability
    sum_b q_b x p_b, p_b the share of decisions whose true bucket is b. Without the shares, q_b is C-MLFQ's
    own share of choices (Cohen's chance agreement). `low()`: C-MLFQ's accuracy does not exceed that by
    FALLBACK_Z standard errors, so its moves and placements buy nothing the fallback would not.

    kinds[b]: what the servers of bucket b are (their TP, when the policy knows it): buckets of the same kind
    are the same hardware, so a decision is right when it chose a bucket of the right kind (default: every
    bucket its own kind)."""

    def __init__(self, n_buckets: int, window: int, kinds: Sequence[int] | None = None) -> None:
        if window < 1:
            raise ValueError(f"fallback_window must be >= 1, got {window}")
        names = list(range(n_buckets)) if kinds is None else list(kinds)
        if len(names) != n_buckets:
            raise ValueError(f"{len(names)} bucket kinds for {n_buckets} buckets")
        order = sorted(set(names), key=names.index)
        self.kind = [order.index(k) for k in names]  # bucket -> kind index
        self.n = len(order)
        self.scored: deque[tuple[int, int]] = deque(maxlen=window)  # (chosen, true) kinds, oldest first

    def add(self, chosen: int, true: int) -> None:
        """A scored decision: the bucket chosen and the bucket of the final length."""
        self.scored.append((self.kind[chosen], self.kind[true]))

    def stats(self, shares: Sequence[float] | None = None) -> tuple[int, float, float]:
        """(decisions scored, measured accuracy, the fallback's accuracy on them): shares[b] = the share of
        requests the fallback puts in bucket b (None: C-MLFQ's own shares)."""
        n = len(self.scored)
        if n == 0:
            return 0, 0.0, 0.0
        chosen, true = [0] * self.n, [0] * self.n
        right = 0
        for c, t in self.scored:
            chosen[c] += 1
            true[t] += 1
            right += c == t
        if shares is None or len(shares) != len(self.kind) or not sum(shares) > 0:
            q = [c / n for c in chosen]
        else:
            q = [0.0] * self.n
            for b, x in enumerate(shares):
                q[self.kind[b]] += max(0.0, float(x)) / sum(shares)
        return n, right / n, sum(a * b / n for a, b in zip(q, true))

    def low(self, shares: Sequence[float] | None = None) -> bool:
        n, acc, base = self.stats(shares)
        # Before FALLBACK_MIN_DECISIONS nothing is measured yet: no verdict (C-MLFQ decides).
        return n >= FALLBACK_MIN_DECISIONS and acc <= base + FALLBACK_Z * math.sqrt(acc * (1.0 - acc) / n)


@dataclass
class CMLFQConfig:
    min_samples: int = 4  # a node needs this many samples before it is trusted
    window: int = 200  # samples per node for mean / P90 (public Libra code)
    max_nodes: int = 200_000  # memory bound; least recently used subtrees are evicted
    size_small: int = 500  # payload size classes (tokens)
    size_medium: int = 5000
    rebuild_every: int = 0  # rebuild the tree every N inserted trajectories (0: never)
    rebuild_window: int = 5000  # ...from this many most recent trajectories
    online_siblings: bool = False  # insert finished trajectories at once (siblings of a running prompt see them)
    # The default below was chosen on PolyTrace Search-R1 steps 0-1 -> 2 (README "cmlfq"); the paper's rule
    # is center=None. Whether a move pays for its re-prefill is priced by the Cost Evaluator
    # (cmlfq/migration.py) when the policy knows its buckets' servers (`pricer`).
    overrun: bool = False  # when the context already overruns the bucket and mean/P90 disagree, go by the mean
    center: float | None = 0.3  # what must agree with the P90: None = the mean (paper), or a quantile q
    # Place the start by the centre estimate of the prompt's root (paper: always start shortest). Placing
    # moves nothing, so it needs no mean/P90 agreement. Where prompts do not recur, the global root speaks.
    start_lookup: bool = True
    # When the deepest trusted node is shallower than the request (a rare state sequence), read its
    # remaining-length samples from that node's decision point, keeping those that grew at least as far
    # as this request already has (paper: use the node's remaining length as if it were measured now).
    condition: bool = True
    # Use the prompt's own deepest trusted node even when the global subtree matches deeper (the prompt's
    # history says more than a deeper match over all prompts; needs `condition` to read a shallow node).
    prompt_first: bool = True
    # Which parts of a tool-return state key the tree: any of "tool", "size", "status" (paper: all three).
    state_key: str = "tool,size,status"
    # Correct the tree for length drift across training steps (scheduler/drift.py): remaining lengths are
    # stored divided by their step's length level and read times the level extrapolated to the routed
    # step, fitted on the newest `drift_steps` visible steps. With drift on, the tree is rebuilt from the
    # last `rebuild_window` trajectories at every step boundary (the levels are re-estimated there).
    drift: bool = False
    drift_steps: int = 8
    # At a tool return, scale the node's remaining lengths by (this request's growth past its prompt /
    # the prompt's typical growth at the same depth) ** growth (0: off). Per-sample persistence.
    growth: float = 0.0
    # Auto mode (scheduler/auto.py): at each step boundary choose center, overrun, growth,
    # state_key, drift and window by leave-one-step-out validation on the visible steps, and let MLFQ decide
    # in the regions (depth, overrun) where its decisions validate better. None = on unless one of those
    # switches is set away from its default (explicit settings then run as given); True with explicit
    # switches keeps them pinned and chooses the rest; False = the switches as set.
    auto: bool | None = None
    auto_steps: int = 3  # the newest visible steps validated on (one fold each)
    auto_sample: int = 192  # held-out trajectories per fold (whole prompts, CRC order)
    auto_train: int = 512  # training trajectories per visible step in a fold
    # Regions where MLFQ's decision is taken instead of the tree's: "all", or "/"-separated depths 0-3
    # (3 = three or more tool returns) with an optional "o" = the context overruns the current bucket.
    mlfq_at: str = ""
    # Validate in a background thread (the live dispatcher: no stall at the step boundary); the choice
    # applies at the first decision after it is ready. Off: at the boundary itself (replay, simulator).
    auto_background: bool = False
    backend: str = "auto"
    tree_path: str | None = None  # load this tree file (empty tree + warning if it is missing or broken)
    # Least-loaded fallback (module `Fallback`): route least-loaded inside the buckets, without moves, while
    # the measured decision accuracy is not above a length-blind router's. Off for a replay of lengths
    # (nothing is loaded there); the simulator and the live router turn it on.
    fallback: bool = False
    fallback_window: int = 2000  # decisions of recently finished trajectories the accuracy is measured on


class CMLFQPolicy(_Base):
    """C-MLFQ: start in the shortest bucket; at each tool return look up the deepest matching node of the
    causal prefix tree and migrate only when the buckets of context + mean remaining and of context + P90
    remaining agree and differ from the current bucket, and (with a `pricer`, cmlfq/migration.py) the decode
    GPU time the predicted remaining length saves on the target exceeds the re-prefill's. With
    `fallback` on, it routes least-loaded inside the buckets (no moves) while its measured decision accuracy
    is not above chance (DecisionAccuracy), still deciding in the shadow so it can earn its way back.

    pricer: a MigrationPricer for these buckets (None: moves are not priced, e.g. a replay of lengths with
    no servers). load_fn: requests (running and queued) per GPU of each bucket, read by the fallback and the
    price (None: the fallback counts its own placements, the price takes the servers as full)."""

    name = "cmlfq"

    def __init__(self, buckets: Sequence[int | Bucket], config: CMLFQConfig | None = None,
                 tree: PrefixTree | None = None, pricer=None, load_fn: Callable[[], Sequence[float]] | None = None,
                 **switches) -> None:
        super().__init__(buckets)
        if pricer is not None and len(pricer.tps) != len(self.buckets):
            raise ValueError(f"the pricer has {len(pricer.tps)} buckets, the policy {len(self.buckets)}")
        self.pricer = pricer
        self._ll = LeastLoadedPolicy(self.buckets, load_fn)
        # GPUs of each bucket (set by the caller that runs the servers): the fallback's placement shares.
        self.bucket_gpus: Sequence[float] | None = None
        self.fallback_active = False  # the verdict of the last step boundary
        self.routed_decisions = 0  # starts and tool returns routed
        self.fallback_decisions = 0  # ... of which the fallback routed
        self.priced_out = 0  # moves the tree wanted that did not pay for their re-prefill
        self._made: dict[str, list[int]] = {}  # C-MLFQ's own decisions per running trajectory (scored at finish)
        cfg = config or CMLFQConfig()
        for k, v in switches.items():
            if not hasattr(cfg, k):
                raise ValueError(f"unknown cmlfq switch {k!r}")
            setattr(cfg, k, v)
        self.config = cfg
        self.accuracy = DecisionAccuracy(len(self.buckets), cfg.fallback_window,
                                         None if pricer is None else pricer.tps)
        self.sizes = SizeClasses(cfg.size_small, cfg.size_medium)
        kw = dict(min_samples=cfg.min_samples, window=cfg.window, max_nodes=cfg.max_nodes, sizes=self.sizes,
                  backend=cfg.backend)
        self._mask = self._parse_mask(cfg.state_key)
        cfg.mlfq_at = "" if cfg.mlfq_at is None else str(cfg.mlfq_at)  # a CLI may pass "0" as an int
        self._mlfq_at = parse_regions(cfg.mlfq_at)
        defaults = CMLFQConfig()
        explicit = {k: getattr(cfg, k) for k in TUNED if getattr(cfg, k) != getattr(defaults, k)}
        self.auto = not explicit if cfg.auto is None else bool(cfg.auto)
        self._pinned = explicit if self.auto else {}
        self.auto_choice: AutoChoice | None = None
        self.auto_log: list[AutoChoice] = []  # every choice made, oldest first (bounded)
        self._by_step: dict[int, list[Trajectory]] = {}  # visible trajectories of the newest steps
        self._auto_key: tuple[int, int] | None = None
        self._auto_worker: threading.Thread | None = None
        self._auto_ready: tuple[AutoChoice | None] | None = None  # a background choice not yet applied
        self.drift = LengthDrift(cfg.drift_steps) if cfg.drift else None
        self.growth: GrowthTable | None = None  # of the tree's backend: created with the tree, below
        self._drift_dirty = False
        if self.drift is not None and (tree is not None or cfg.tree_path):
            # The given tree's samples are in some other policy's units and cannot be re-expressed.
            log.warning("cmlfq drift: the tree is rebuilt from this policy's own trajectories at each step "
                        "boundary; the samples of the given tree are dropped at the first one")
        if tree is not None:
            self.tree = tree
        elif cfg.tree_path:
            self.tree = PrefixTree.load_or_empty(cfg.tree_path, **kw)
        else:
            self.tree = PrefixTree(**kw)
        if cfg.growth:
            self.growth = self.tree.growth_table()
            self._install_rule()
        # Contexts at each decision point of running trajectories, for callers that do not pass
        # RequestInfo.decision_contexts (bounded: the oldest entries go first).
        self._contexts: dict[str, tuple[int, ...]] = {}
        self._recent: deque[Trajectory] = deque(maxlen=cfg.rebuild_window)
        self._since_rebuild = 0
        self._pending: list[Trajectory] = []
        self.decisions = 0
        self.lookups_from_global = 0

    @staticmethod
    def _parse_mask(state_key: str) -> tuple[bool, bool, bool] | None:
        parts = {p.strip() for p in state_key.split(",") if p.strip()}
        if not parts <= {"tool", "size", "status"}:
            raise ValueError(f"state_key must list tool, size and/or status, got {state_key!r}")
        return None if len(parts) == 3 else ("tool" in parts, "size" in parts, "status" in parts)

    @property
    def tree(self) -> PrefixTree:
        return self._tree

    @tree.setter
    def tree(self, tree: PrefixTree) -> None:
        """Install a tree (also a rebuilt or reloaded one): the state coarsening and the bucket rule go
        with it, so a swapped-in tree decides exactly like the one it replaces."""
        if self._mask is not None:
            tree.state_map = self._masked
        self._tree = tree
        self._tree_decide = tree.request_decider()  # bound once: one call into the core per decision
        if self.growth is not None and not tree.accepts_growth(self.growth):
            # A tree of the other backend (never swapped in by this package): the core reads only its own
            # kind of growth table, so it is refilled from the recent window.
            self.growth = tree.growth_table()
            for t in self._recent:
                self.growth.add(t.prompt_id, t.prompt_tokens, decision_contexts(t), self._level_of(t))
        if self.auto and self.auto_choice is None:
            # Nothing validated yet: an empty tree never moves a request, so MLFQ decides until it learns.
            self._mlfq_at = ALL_REGIONS if tree.node_count() <= 1 else parse_regions(self.config.mlfq_at)
        self._install_rule()

    def _install_rule(self) -> None:
        """Install the bucket rule and the drift/growth state in the tree core: done when they change (a
        tree swap, a step boundary's refit, new switches), never per decision. The tree holds lengths in
        units of the reference level; the core computes each request's multiplier from this state."""
        cfg = self.config
        self._tree.set_rule(self.buckets, cfg.center is None, 0.5 if cfg.center is None else float(cfg.center),
                            bool(cfg.overrun), bool(cfg.condition), bool(cfg.prompt_first))
        self._tree.set_scaling(self.drift, self.growth, float(cfg.growth) if self.growth is not None else 0.0)

    # --- learning ---
    def _level_of(self, traj: Trajectory) -> float:
        return self.drift.level(traj.step) if self.drift is not None else 1.0

    def _insert(self, traj: Trajectory) -> None:
        self._recent.append(traj)
        if self.auto:
            self._by_step.setdefault(traj.step, []).append(traj)
        if self.drift is not None:
            self.drift.add(traj)
            self._drift_dirty = True
        level = self._level_of(traj)
        self.tree.insert(traj, level)
        if self.growth is not None:
            self.growth.add(traj.prompt_id, traj.prompt_tokens, decision_contexts(traj), level)
        self._since_rebuild += 1
        if self.config.rebuild_every and self._since_rebuild >= self.config.rebuild_every:
            self._rebuild()

    def _rebuild(self) -> None:
        """Rebuild the tree (and the growth table) from the recent window, at the current levels."""
        self.tree.rebuild(self._recent, self._level_of if self.drift is not None else None)
        if self.growth is not None:
            self.growth.clear()
            for t in self._recent:
                self.growth.add(t.prompt_id, t.prompt_tokens, decision_contexts(t), self._level_of(t))
        self._since_rebuild = 0

    def _refit_drift(self) -> None:
        """At a step boundary: re-estimate the levels from the visible steps and re-express the tree in
        the new reference level (a rebuild from the recent window)."""
        if self.drift is None or not self._drift_dirty:
            return
        self._drift_dirty = False
        self.drift.refit()
        self._rebuild()
        self._install_rule()  # the new levels reach the core

    def fit(self, trajs: Iterable[Trajectory]) -> None:
        for t in trajs:
            self._insert(t)
        self._refit_drift()
        self._auto_choose()

    def set_pricer(self, pricer) -> None:
        """Price moves with `pricer` from now on (the live router learns the cost spec after it starts); the
        accuracy is then scored per server kind (the pricer's TPs), from scratch if the kinds changed."""
        if pricer is not None and len(pricer.tps) != len(self.buckets):
            raise ValueError(f"the pricer has {len(pricer.tps)} buckets, the policy {len(self.buckets)}")
        self.pricer = pricer
        acc = DecisionAccuracy(len(self.buckets), self.config.fallback_window, None if pricer is None else pricer.tps)
        if acc.kind != self.accuracy.kind:
            self.accuracy = acc

    @property
    def load_fn(self) -> Callable[[], Sequence[float]] | None:
        return self._ll.load_fn

    @load_fn.setter
    def load_fn(self, fn: Callable[[], Sequence[float]] | None) -> None:
        self._ll.load_fn = fn

    def fallback_fraction(self) -> float | None:
        """Share of the routed decisions the least-loaded fallback made (None before any decision)."""
        return self.fallback_decisions / self.routed_decisions if self.routed_decisions else None

    def _score(self, traj: Trajectory) -> None:
        made = self._made.pop(traj.trajectory_id, None)
        if made:
            true = self.bucket_of(traj.final_length)
            for b in made:
                self.accuracy.add(b, true)

    def finish(self, traj: Trajectory) -> None:
        self._contexts.pop(traj.trajectory_id, None)
        self._score(traj)
        self._ll.finish(traj)
        if self.config.online_siblings:
            self._insert(traj)
            return
        # Without sibling updates the tree only learns from earlier steps: hold a step's finishes until
        # the step ends (end_step) or a newer step's trajectory finishes.
        if self._pending and traj.step > self._pending[-1].step:
            self.end_step()
        self._pending.append(traj)

    def end_step(self) -> None:
        for t in self._pending:
            self._insert(t)
        self._pending = []
        self._refit_drift()
        self._auto_choose()
        # The fallback verdict for the next step, from the decisions scored so far.
        self.fallback_active = bool(self.config.fallback) and self.accuracy.low(self.bucket_gpus)

    # --- auto mode ---
    def _auto_choose(self) -> None:
        """Once per step: re-choose the switches when a newer step became visible (or, for a caller that
        does not tag steps, when the visible history doubled since the last choice)."""
        if not self.auto or not self._by_step:
            return
        keep = sorted(self._by_step)[-max(1, self.config.auto_steps):]
        self._by_step = {k: self._by_step[k] for k in keep}
        n = sum(len(v) for v in self._by_step.values())
        if self._auto_key is not None and keep[-1] == self._auto_key[0] and n < 2 * self._auto_key[1]:
            return
        if self._auto_worker is not None and self._auto_worker.is_alive():
            return  # the previous step's validation is still running (background mode): next boundary
        self._auto_key = (keep[-1], n)
        cfg = self.config
        # The policy classes are handed to auto (which replays candidates of them), so auto needs no import of
        # this module.
        args = ({k: list(v) for k, v in self._by_step.items()}, self.buckets, replace(cfg), CMLFQPolicy,
                MLFQPolicy, dict(self._pinned), cfg.auto_steps, cfg.auto_sample, cfg.auto_train, self.pricer)
        if not cfg.auto_background:
            self._take_choice(choose(*args))
            return

        def work() -> None:
            try:
                self._auto_ready = (choose(*args),)
            except Exception as e:  # noqa: BLE001 - a failed validation keeps the current switches
                log.warning("cmlfq auto: validation failed (%s: %s); keeping the switches", type(e).__name__, e)

        self._auto_worker = threading.Thread(target=work, name="cmlfq-auto", daemon=True)
        self._auto_worker.start()

    def wait_auto(self, timeout: float | None = None) -> None:
        """Wait for a background validation and apply its choice (tests, shutdown)."""
        w = self._auto_worker
        if w is not None:
            w.join(timeout)
        self._poll_auto()

    def _poll_auto(self) -> None:
        ready, self._auto_ready = self._auto_ready, None
        if ready is not None:
            self._take_choice(ready[0])

    def _take_choice(self, choice: AutoChoice | None) -> None:
        cfg = self.config
        if choice is None:
            # Nothing to validate on (one step of one prompt, say): the tree has learned something, so run
            # the switches as set rather than MLFQ everywhere (the empty tree's stand-in).
            if self.auto_choice is None and self._mlfq_at == ALL_REGIONS:
                self._mlfq_at = parse_regions(cfg.mlfq_at)
            return
        self.auto_choice = choice
        self.auto_log = (self.auto_log + [choice])[-64:]
        log.debug("cmlfq auto: %s", choice.describe())
        self.apply_switches(choice.switches, choice.mlfq_at)

    def apply_switches(self, switches: dict, mlfq_at: str = "") -> None:
        """Switch to other values of the tuned switches (auto.TUNED) between steps. A change of the tree's
        shape (state_key, drift, window) or turning growth on rebuilds the tree from the recent window."""
        cfg = self.config
        unknown = set(switches) - set(TUNED)
        if unknown:
            raise ValueError(f"not a tuned cmlfq switch: {sorted(unknown)}")
        reshape = any(k in switches and switches[k] != getattr(cfg, k) for k in TREE_GRID)
        regrow = bool(switches.get("growth", cfg.growth)) and self.growth is None
        for k, v in switches.items():
            setattr(cfg, k, v)
        cfg.mlfq_at = mlfq_at
        self._mlfq_at = parse_regions(mlfq_at)
        if not cfg.growth:
            self.growth = None
        if reshape or regrow:
            self._mask = self._parse_mask(cfg.state_key)
            self.drift = LengthDrift(cfg.drift_steps) if cfg.drift else None
            if self.drift is not None:
                self.drift.add_all(self._recent)
                self.drift.refit()
            self._drift_dirty = False
            self.growth = None
            old = self.tree
            self.tree = PrefixTree(min_samples=cfg.min_samples, window=cfg.window, max_nodes=cfg.max_nodes,
                                   sizes=self.sizes, backend=old.backend)
            self.growth = self.tree.growth_table() if cfg.growth else None
            self._rebuild()
            self._install_rule()
        else:
            self._install_rule()

    def inherit(self, old: CMLFQPolicy) -> None:
        """Carry another policy's learned state over (the simulator re-plans with new buckets): its tree,
        recent window, auto history and switches; the next step boundary re-validates."""
        for k in TUNED:
            setattr(self.config, k, getattr(old.config, k))
        self.config.mlfq_at = old.config.mlfq_at
        self._mlfq_at = parse_regions(old.config.mlfq_at)
        self._mask = self._parse_mask(self.config.state_key)
        self.drift, self.growth = old.drift, old.growth
        self._recent = deque(old._recent, maxlen=self.config.rebuild_window)
        self._by_step = {k: list(v) for k, v in old._by_step.items()}
        self._auto_key = None
        self.auto_choice, self.auto_log = old.auto_choice, list(old.auto_log)
        self.tree = old.tree
        self.inherit_routing(old)

    def inherit_routing(self, old: CMLFQPolicy) -> None:
        """Carry the measured accuracy, the fallback verdict and the decision counts over a re-plan (the
        bucket indices of the scored decisions keep their meaning only when the bucket count is the same)."""
        if old.accuracy.kind == self.accuracy.kind:
            self.accuracy.scored.extend(old.accuracy.scored)
            self.fallback_active = old.fallback_active and bool(self.config.fallback)
        self.routed_decisions += old.routed_decisions
        self.fallback_decisions += old.fallback_decisions
        self.priced_out += old.priced_out

    def _mlfq_decision(self, req: RequestInfo, current: int) -> int | None:
        """MLFQ's decision when the request's region is one where MLFQ decides, else None."""
        if not req.tool_returns:
            return 0 if (0, False) in self._mlfq_at else None
        over = req.context_tokens > self.buckets[min(current, self._last)]
        if (min(len(req.tool_returns), 3), over) not in self._mlfq_at:
            return None
        return max(current, self.bucket_of(req.context_tokens)) if over else current

    # --- decisions ---
    def _decide(self, req: RequestInfo, current: int, placing: bool = False) -> int:
        """One call into the tree core (C++ or Python, identical), which holds the rule, the switches and the
        drift/growth state (_install_rule): scale the request (drift level of its step, growth factor at
        its depth); look up the deepest trusted node;
        predicted final = context at that node's decision point + its remaining length (centre and P90);
        migrate when both land in the same bucket and it differs from the current one (with the
        overrun and move-cost switches); a first placement takes the centre's bucket."""
        bucket, from_global, _ = self._tree_decide(req, current, placing)  # C++: the only call into it
        self.decisions += 1
        self.lookups_from_global += from_global
        return bucket

    def _move(self, req: RequestInfo, current: int) -> int:
        """The bucket after a tool return: the tree's rule (or MLFQ's in its regions), then the price of the
        move (cmlfq/migration.py): a move whose re-prefill costs more than the remaining decode saves is not
        made."""
        b = self._mlfq_decision(req, current) if self._mlfq_at else None
        remaining = None
        if b is None:
            b, from_global, remaining = self._tree_decide(req, current, False)
            self.decisions += 1
            self.lookups_from_global += from_global
        if b == current or self.pricer is None:
            return b
        if remaining is None:  # MLFQ's region: the tree still predicts the remaining length
            _, _, remaining = self._tree_decide(req, current, False)
        payload = req.tool_returns[-1].payload_tokens if req.tool_returns else 0
        loads = self._loads()
        if not self.pricer.price(req.context_tokens, payload, remaining, current, b, loads).worth:
            self.priced_out += 1
            return current
        return b

    def _loads(self) -> list[float] | None:
        """Requests per server of each bucket (load_fn gives them per GPU), or None without a load."""
        fn = self._ll.load_fn
        return None if fn is None or self.pricer is None else [x * tp for x, tp in zip(fn(), self.pricer.tps)]

    def _priced_start(self, req: RequestInfo, b: int, remaining: float | None, from_global: bool) -> int:
        """A placement moves nothing, but it loads a bucket: with a price and the buckets' load, the tree's
        bucket is kept unless the least-loaded bucket would decode the predicted length sooner (the same
        Cost Evaluator time per token as a move's saving). A prediction from the global root (the prompt has
        no trusted history) is the same for every such request, so it tells them apart no better than
        chance: they go to the least-loaded bucket."""
        loads = self._loads()
        if loads is None or not remaining:
            return b
        ll = min(range(len(loads)), key=lambda i: (loads[i] / self.pricer.tps[i], i))
        if ll == b or from_global:
            return ll
        ctx = req.context_tokens
        t_b = self.pricer.token_s(b, ctx, remaining, loads[b] + 1.0)
        t_ll = self.pricer.token_s(ll, ctx, remaining, loads[ll] + 1.0)
        return ll if t_ll < t_b else b

    def _record(self, trajectory_id: str, bucket: int, first: bool) -> None:
        made = self._made.get(trajectory_id)
        if first or made is None:
            if len(self._made) >= 1_000_000:  # trajectories that never finish (aborted): drop the oldest
                del self._made[next(iter(self._made))]
            self._made[trajectory_id] = [bucket]
        else:
            made.append(bucket)

    def _track(self, req: RequestInfo) -> RequestInfo:
        """Fill in decision_contexts from earlier calls for this trajectory when the caller did not."""
        n = len(req.tool_returns)
        if len(req.decision_contexts) == n + 1:  # the caller tracks them (replay, Dispatcher)
            return req
        prev = self._contexts.get(req.trajectory_id)
        if n == 0:
            dctx: tuple[int, ...] = (req.context_tokens,)
        elif prev is not None and len(prev) == n:
            dctx = prev + (req.context_tokens,)
        else:
            self._contexts.pop(req.trajectory_id, None)
            return req
        if len(self._contexts) >= 1_000_000 and req.trajectory_id not in self._contexts:
            del self._contexts[next(iter(self._contexts))]
        self._contexts[req.trajectory_id] = dctx
        return replace(req, decision_contexts=dctx)

    def start(self, req: RequestInfo) -> int:
        if self._auto_ready is not None:
            self._poll_auto()
        req = self._track(req)
        if not self.config.start_lookup or (self._mlfq_at and (0, False) in self._mlfq_at):
            b, remaining, from_global = 0, None, True
        else:
            b, from_global, remaining = self._tree_decide(req, 0, True)
            self.decisions += 1
            self.lookups_from_global += from_global
        b = self._priced_start(req, b, remaining, from_global)
        self._record(req.trajectory_id, b, True)
        self.routed_decisions += 1
        if self.fallback_active:
            self.fallback_decisions += 1
            return self._ll.start(req)
        return b

    def tool_return(self, req: RequestInfo, current: int) -> int:
        if self._auto_ready is not None:
            self._poll_auto()
        req = self._track(req)
        self.routed_decisions += 1
        if self.fallback_active:
            # Decide in the shadow, from where C-MLFQ would have put the request, so the accuracy keeps
            # being measured; the request itself stays where the fallback placed it.
            made = self._made.get(req.trajectory_id)
            self._record(req.trajectory_id, self._move(req, made[-1] if made else current), False)
            self.fallback_decisions += 1
            return current
        b = self._move(req, current)
        self._record(req.trajectory_id, b, False)
        return b

    def _masked(self, st: ToolState) -> ToolState:
        tool, size, status = self._mask
        return ToolState(st.tool if tool else "*", st.size_class if size else "*", st.status if status else "*")


POLICIES: dict[str, type] = {
    "cmlfq": CMLFQPolicy,
    "round_robin": RoundRobinPolicy,
    "least_loaded": LeastLoadedPolicy,
    "mlfq": MLFQPolicy,
    "predictor": PredictorPolicy,
    "oracle": OraclePolicy,
}


def make_policy(name: str, buckets: Sequence[int | Bucket], **switches) -> _Base:
    """Build a policy by name; switches go to its constructor (for cmlfq: CMLFQConfig fields)."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    return cls(buckets, **switches)
