"""Joint planner: split a fixed GPU budget between training and rollout, minimising
max(T_train, T_rollout) per step.

T_train(g) for each training GPU count g comes from the decision tree; T_rollout(r) from the rollout DP.
Both are monotone in the makespan target T, so the optimum is the smallest candidate T for which
(fewest training GPUs meeting T) + (fewest rollout GPUs meeting T) <= N: a bisection over the sorted
candidate makespans. Among the training sizes that achieve it, the planner keeps the one whose
exact-budget rollout plan (leftover GPUs added as servers to the slowest groups) is best.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from areal_libra.cost.presets import ClusterSpec, ModelSpec, load_cluster, load_model
from areal_libra.cost.rollout import RolloutCost
from areal_libra.cost.training import BatchStats, TrainCost, TrainParallel
from areal_libra.planner.rollout_dp import Group, RolloutDP, RolloutSolution, smallest_feasible
from areal_libra.planner.train_tree import TreeConfig, TreeResult, search
from areal_libra.planner.types import DEFAULT_TP, Interval, Plan, PlanError, PlannerConfig, RolloutInstance


def tail_rows(n: int, global_batch: int) -> int:
    """How many of `n` history rows form the tail sample: the top n / (B + 1), the share of the history at
    and above the expected longest request of one batch of B (the B/(B+1) quantile). The critical path a
    step pays is one batch's longest request, not the longest of the whole history, which grows with its
    size (a 2,000-trajectory history holds the longest of 15 batches of 128)."""
    return max(1, min(n - 1, int(round(n / (global_batch + 1.0)))))


def sample_history(history: Sequence[tuple[int, int]] | np.ndarray, n_samples: int, global_batch: int):
    """Stratified sample of (prompt_tokens, final_length) pairs: sort by final length; the tail (the top
    `tail_rows` requests, at least the longest one) is a sample of its own (the tail sets the critical
    path), the rest is cut into n_samples - 1 strata of nearly equal size, each stratum represented by its
    mean prompt and final length (keeps the total work). Weights: real requests of one rollout batch per
    sample. Returns prompts, outputs, weights, stratum min and max final length, all sorted by final length."""
    arr = np.asarray(history, dtype=float).reshape(-1, 2)
    arr = arr[np.argsort(arr[:, 1], kind="stable")]
    n = len(arr)
    if n <= n_samples:
        w = np.full(n, global_batch / n)
        f = arr[:, 1].astype(int)
        return arr[:, 0], arr[:, 1] - arr[:, 0], w, f, f.copy()
    m = tail_rows(n, global_batch)
    body, k = n - m, n_samples - 1
    if body < k:  # not enough rows below the tail for every stratum: a shorter tail
        body, m = k, n - k
    bounds = (np.arange(k + 1) * body) // k  # strata of nearly equal size, like np.array_split
    bounds = np.append(bounds, n)  # the last stratum: the tail
    cp = np.concatenate([[0.0], np.cumsum(arr[:, 0])])
    cf = np.concatenate([[0.0], np.cumsum(arr[:, 1])])
    a, b = bounds[:-1], bounds[1:]
    size = (b - a).astype(float)
    prompts = (cp[b] - cp[a]) / size
    finals = (cf[b] - cf[a]) / size
    weights = size / n * global_batch
    lo = arr[a, 1].astype(int)
    hi = arr[b - 1, 1].astype(int)
    return prompts, finals - prompts, weights, lo, hi


def _validate(cluster: ClusterSpec, history: Sequence[tuple[int, ...]], cfg: PlannerConfig) -> np.ndarray:
    """Check the inputs; returns the history as an int64 array of 2 or 3 columns."""
    n = cluster.n_gpus
    if n < 2:
        raise PlanError(f"cluster has {n} GPU(s); a plan needs at least 1 training and 1 rollout GPU")
    if not cfg.allowed_tp:
        raise PlanError("allowed TP list is empty")
    for tp in _rollout_tps(cluster, cfg):
        if tp < 1:
            raise PlanError(f"allowed TP {tp} must be >= 1")
        if tp > cluster.gpus_per_node:
            raise PlanError(f"allowed TP {tp} is larger than a node ({cluster.gpus_per_node} GPUs per node)")
    if cfg.mode not in ("sync", "async"):
        raise PlanError(f"planner mode must be 'sync' or 'async', got {cfg.mode!r}")
    if cfg.staleness < 0:
        raise PlanError(f"staleness must be >= 0, got {cfg.staleness}")
    if cfg.global_batch < 1:
        raise PlanError(f"global batch must be >= 1, got {cfg.global_batch}")
    if cfg.n_samples < 1:
        raise PlanError(f"n_samples must be >= 1, got {cfg.n_samples}")
    if len(history) == 0:
        raise PlanError("the length history is empty")
    try:
        arr = np.asarray(history, dtype=np.int64)
    except (ValueError, TypeError):
        arr = np.empty((0, 0))
    if arr.ndim != 2 or arr.shape[1] not in (2, 3):
        raise PlanError("bad history: every entry must be (prompt_tokens, final_length) or (prompt_tokens, "
                        "final_length, model_tokens), all of the same kind")
    bad = np.nonzero((arr[:, 0] < 0) | (arr[:, 1] < arr[:, 0]))[0]
    if len(bad):
        p, f = arr[bad[0], :2]
        raise PlanError(f"bad history entry (prompt_tokens={p}, final_length={f}): need 0 <= prompt <= final")
    if arr.shape[1] == 3:
        bad = np.nonzero((arr[:, 2] < 0) | (arr[:, 2] > arr[:, 1] - arr[:, 0]))[0]
        if len(bad):
            p, f, g = arr[bad[0]]
            raise PlanError(f"bad history entry (prompt_tokens={p}, final_length={f}, model_tokens={g}): need "
                            f"0 <= model_tokens <= final - prompt")
    if cfg.min_train_gpus + cfg.min_rollout_gpus > n:
        raise PlanError(f"min_train_gpus {cfg.min_train_gpus} + min_rollout_gpus {cfg.min_rollout_gpus} exceed "
                        f"the cluster's {n} GPUs")
    return arr


def _rollout_tps(cluster: ClusterSpec, cfg: PlannerConfig) -> tuple[int, ...]:
    """The default TP list is trimmed to the node size; an explicit list is taken as given (and checked)."""
    if cfg.allowed_tp == DEFAULT_TP:
        return tuple(tp for tp in cfg.allowed_tp if tp <= cluster.gpus_per_node)
    return cfg.allowed_tp


def _rollout_costs(cluster: ClusterSpec, model: ModelSpec, cfg: PlannerConfig, longest: int) -> dict[int, RolloutCost]:
    costs = {tp: RolloutCost(cluster.hardware, model, tp, cfg.max_running)
             for tp in sorted(set(_rollout_tps(cluster, cfg)))}
    usable = {tp: rc for tp, rc in costs.items() if rc.kv_capacity_tokens() >= longest}
    if usable:
        return usable
    hw = cluster.hardware
    big = max(costs)
    if not costs[big].fits():
        room = big * (hw.hbm_bytes - hw.workspace_bytes)
        raise PlanError(f"{model.name} does not fit any rollout server: weights {model.weight_bytes / 1e9:.1f} GB > "
                        f"TP{big} memory after workspace {room / 1e9:.1f} GB (allowed TP {cfg.allowed_tp})")
    raise PlanError(f"the longest request ({longest} tokens) exceeds the KV capacity of every allowed rollout TP "
                    f"(TP{big}: {costs[big].kv_capacity_tokens()} tokens of KV cache)")


def _train_frontier(tcost: TrainCost, st: BatchStats, n: int, cfg: PlannerConfig, tree_cfg: TreeConfig
                    ) -> dict[int, TreeResult]:
    m, c = tcost.model, tcost.cluster
    lo = max(1, cfg.min_train_gpus)
    hi = min(cfg.max_train_gpus or n, n - cfg.min_rollout_gpus)
    tps = [tp for tp in tree_cfg.allowed_tp if tp <= c.gpus_per_node and m.n_heads % tp == 0]
    pps = [pp for pp in range(1, min(m.n_layers, tree_cfg.max_pp) + 1) if m.n_layers % pp == 0]
    out: dict[int, TreeResult] = {}
    trees: list[TreeResult] = []
    for g in range(lo, hi + 1):
        # Skip sizes no layout can use (TP x PP must divide the GPUs, DP at most the batch) before building a
        # tree. DP need not divide the batch: the trainer balances tokens over ranks.
        if not any(g % (tp * pp) == 0 and g // (tp * pp) <= st.n for tp in tps for pp in pps):
            continue
        res = _search(tcost, g, st, tree_cfg)
        trees.append(res)
        if res.best is not None:
            out[g] = res
    if out:
        return out
    if not trees:
        raise PlanError(f"no training size in {lo}..{hi} GPUs admits a layout: TP x PP must divide the GPU count "
                        f"and DP be at most the global batch {st.n}")
    hbm = c.hardware.hbm_bytes
    min_mem = min(t.min_memory for t in trees)
    kinds = Counter(r.kind for t in trees for r in t.log if r.kind != "bound")
    if min_mem > hbm or kinds.most_common(1)[0][0] == "memory":
        raise PlanError(f"{m.name} cannot be trained on up to {hi} {c.hardware.name} GPUs: the leanest layout needs "
                        f"{min_mem / 1e9:.1f} GB per GPU > {hbm / 1e9:.0f} GB HBM (memory is the binding constraint)")
    kind = kinds.most_common(1)[0][0]
    example = next(r for t in trees for r in t.log if r.kind == kind)
    raise PlanError(f"no training layout is feasible; binding constraint: {kind} (e.g. {example.branch}: "
                    f"{example.reason})")


# The training tree's results by (cost model, size, batch, tree config): a deterministic search that one
# split-rule solve asks for the same inputs up to 25 times (each single TP, each fixed-point pass). Bounded:
# a long live run's batches differ every re-plan.
_TREE_CACHE: dict = {}
_TREE_CACHE_MAX = 4096


def _search(tcost: TrainCost, g: int, st: BatchStats, tree_cfg: TreeConfig) -> TreeResult:
    key = (tcost.identity, g, st, tree_cfg)
    res = _TREE_CACHE.get(key)
    if res is None:
        if len(_TREE_CACHE) >= _TREE_CACHE_MAX:
            _TREE_CACHE.pop(next(iter(_TREE_CACHE)))
        res = _TREE_CACHE[key] = search(tcost, g, st, tree_cfg)
    return res


def _pareto(frontier: dict[int, TreeResult]) -> list[tuple[int, TreeResult]]:
    """Training sizes that are faster than every smaller size."""
    out, best = [], math.inf
    for g in sorted(frontier):
        if frontier[g].t_s < best:
            out.append((g, frontier[g]))
            best = frontier[g].t_s
    return out


def solve(cluster: ClusterSpec | str, model: ModelSpec | str, history: Sequence[tuple[int, ...]],
          cfg: PlannerConfig | None = None) -> Plan:
    """Plan the training layout and the rollout server mix for `cluster` from a (prompt_tokens,
    final_length) history. Raises PlanError naming the binding constraint when nothing is feasible.

    An entry may carry a third element, the trajectory's model (generated) tokens: then only those are
    decoded and the rest of the final context (prompt and tool returns) is prefilled. With two elements
    everything after the prompt counts as decoded, which overstates decode work for agentic traces."""
    t0 = time.perf_counter()
    cfg = cfg or PlannerConfig()
    cluster = load_cluster(cluster)
    model = load_model(model)
    if cfg.routing == "blind" and len(_rollout_tps(cluster, cfg)) > 1:  # no mix beats one TP (PlannerConfig.routing)
        _validate(cluster, history, cfg)  # bad input named as such, not as "no single TP"
        best = best_single_tp(cluster, model, history, replace(cfg, routing="by_length"))
        if best is None:
            raise PlanError("no single rollout TP serves this history, and a length-blind router cannot use a mix")
        return best
    arr = _validate(cluster, history, cfg)
    plan = _solve_at(cluster, model, arr, cfg, 0.0, t0)
    if cfg.mode == "async" and cfg.sustained_concurrency:
        plan = sustained_fixed_point(lambda step_s: _solve_at(cluster, model, arr, cfg, step_s, t0),
                                     lambda p: p.makespan_s, plan, cfg.rollout_factor)
    if cfg.split == "homogeneous" and len(_rollout_tps(cluster, cfg)) > 1 and len({i.tp for i in plan.instances}) > 1:
        plan = split_on_homogeneous(cluster, model, history, cfg, plan)
    return plan


def best_single_tp(cluster: ClusterSpec | str, model: ModelSpec | str, history: Sequence[tuple[int, ...]],
                   cfg: PlannerConfig) -> Plan | None:
    """The plan of least predicted makespan among those with a single rollout TP from cfg's allowed list (first
    of equals, in list order; fillers of other TPs allowed); None when no single TP gives a plan."""
    best = None
    for tp in _rollout_tps(load_cluster(cluster), cfg):
        try:
            p = solve(cluster, model, history, replace(cfg, allowed_tp=(tp,)))
        except PlanError:
            continue
        if best is None or p.makespan_s < best.makespan_s:
            best = p
    return best


def split_on_homogeneous(cluster: ClusterSpec, model: ModelSpec, history: Sequence[tuple[int, ...]],
                         cfg: PlannerConfig, joint_plan: Plan) -> Plan:
    """PlannerConfig.split "homogeneous": the training GPUs of the best single-TP plan, and within the rollout
    budget they leave the best mix; the single-TP plan itself where the mix does not beat it, and `joint_plan`
    (the joint solve's, already made) where no single TP serves the history."""
    joint = replace(cfg, split="joint")
    homo = best_single_tp(cluster, model, history, joint)
    if homo is None:  # no single TP serves this history: only a mix does
        return joint_plan
    g = homo.train_gpus
    try:
        mixed = solve(cluster, model, history, replace(joint, min_train_gpus=g, max_train_gpus=g))
    except PlanError:
        return homo
    return mixed if mixed.makespan_s <= homo.makespan_s else homo


# Passes of the step's fixed point (sustained_fixed_point) and the tolerance that ends it early.
SUSTAIN_PASSES = 4
SUSTAIN_TOL = 0.02


def sustained_fixed_point(at, step_of, first, rollout_factor: float):
    """The asynchronous loop's step as a fixed point: the servers' concurrency follows the step (a slower step
    needs fewer requests running, RolloutCost.group_makespan_s `step_s`), and the step follows the prices.
    `first` is the result at the window's full concurrency (the slowest prices); `at(step_s)` re-prices at a
    step given in the rollout model's seconds (measured / rollout_factor). The predicted step falls as step_s
    grows, so the plain iteration alternates around the fixed point: each pass takes the mean of the two."""
    out, s = first, step_of(first) / rollout_factor
    for _ in range(SUSTAIN_PASSES):
        out = at(s)
        m = step_of(out) / rollout_factor
        if abs(m - s) <= SUSTAIN_TOL * s:
            break
        s = (s + m) / 2.0
    return out


def _solve_at(cluster: ClusterSpec, model: ModelSpec, arr: np.ndarray, cfg: PlannerConfig, step_s: float,
              t0: float) -> Plan:
    """solve() with the rollout servers priced at the concurrency a loop stepping every `step_s` sustains (0:
    the window's full concurrency)."""
    # (prefilled tokens, final length): a 3-element entry moves tool-return tokens from decode to prefill
    history = np.stack([arr[:, 1] - arr[:, 2], arr[:, 1]], axis=1) if arr.shape[1] == 3 else arr[:, :2]
    n = cluster.n_gpus
    prompts, outputs, weights, lo_len, hi_len = sample_history(history, cfg.n_samples, cfg.global_batch)
    finals = history[:, 1].astype(float)
    longest = int(finals.max())
    st = BatchStats(cfg.global_batch, cfg.global_batch * float(finals.mean()),
                    cfg.global_batch * float((finals**2).mean()), longest)

    costs = _rollout_costs(cluster, model, cfg, longest)
    tcost = TrainCost(cluster, model, recompute=cfg.recompute, logprob_passes=cfg.logprob_passes)
    tree_cfg = TreeConfig(allowed_tp=cfg.train_tp, allowed_ep=cfg.train_ep, micro_batches=cfg.micro_batches,
                          max_pp=cfg.max_pp, tp_comm_max=cfg.tp_comm_max, bubble_max=cfg.bubble_max)
    frontier = _train_frontier(tcost, st, n, cfg, tree_cfg)
    pareto = _pareto(frontier)
    max_roll = n - pareto[0][0]
    dp = RolloutDP(costs, prompts, outputs, weights, max_roll, window=cfg.rollout_window,
                   reprefill=cfg.reprefill_on_sync, slot_output=cfg.slot_output, slot_wait_s=cfg.slot_wait_s,
                   length_biased=cfg.length_biased_kv, step_s=step_s)
    rng = dp.value_range()
    if rng is None or dp.min_gpus(rng[1])[0] > max_roll:
        need = dp.min_gpus(rng[1])[0] if rng else math.inf
        raise PlanError(f"rollout needs at least {need:g} GPUs for this history but only {max_roll} remain after the "
                        f"smallest training layout ({pareto[0][0]} GPUs)")

    if cfg.train_factor <= 0 or cfg.rollout_factor <= 0:
        raise PlanError(f"calibration factors must be > 0, got train {cfg.train_factor}, rollout {cfg.rollout_factor}")
    # The split only depends on the ratio of the two factors: solve in the rollout model's seconds with the
    # training times scaled by kf, then scale both sides to measured seconds in the plan (_build_plan).
    kf = cfg.train_factor / cfg.rollout_factor
    g_train = np.array([g for g, _ in pareto])
    t_train = np.array([r.t_s * kf for _, r in pareto])  # strictly decreasing

    def train_need(T: float) -> int:
        ok = np.nonzero(t_train <= T)[0]
        return int(g_train[ok[0]]) if len(ok) else n + 1

    def feasible(T: float) -> bool:
        gt = train_need(T)
        if gt > n:
            return False
        gr = dp.min_gpus(T)[0]
        return gt + max(gr, cfg.min_rollout_gpus) <= n

    def between(lo: float, hi: float) -> np.ndarray:
        tt = t_train[(t_train > lo) & (t_train <= hi)]
        return np.unique(np.concatenate([dp.candidates_between(lo, hi), tt]))

    top = max(rng[1], float(t_train.max()))
    if not feasible(top):
        raise PlanError(f"no split of {n} GPUs serves both sides: training needs >= {pareto[0][0]} GPUs and rollout "
                        f">= {dp.min_gpus(rng[1])[0]:g}")
    t_star = smallest_feasible(feasible, min(rng[0], float(t_train.min())) / 2, top, between)
    r_need = max(dp.min_gpus(t_star)[0], cfg.min_rollout_gpus)
    options = [(g, r) for g, r in pareto if r.t_s * kf <= t_star and g + r_need <= n]
    if len(options) > cfg.max_split_candidates:  # evenly spread, always keeping both ends
        idx = np.unique(np.linspace(0, len(options) - 1, cfg.max_split_candidates).round().astype(int))
        options = [options[i] for i in idx]
    best: tuple | None = None
    for g, res in options:
        sol = dp.best_within(n - g)
        if sol is None:
            continue
        sol, left = dp.fill(sol, n - g)
        key = (max(res.t_s * kf, sol.t_s), left, res.t_s * kf + sol.t_s)
        if best is None or key < best[0]:
            best = (key, g, res, sol, left)
    assert best is not None  # t_star is feasible, so its smallest training option has a rollout plan
    _, g, res, sol, left = best
    # Same makespan and GPU count, but TP rising with length where that costs nothing (cleaner buckets).
    mono = dp.best_within(n - g, monotone=True)
    if mono is not None:
        mono, mono_left = dp.fill(mono, n - g)
        if (max(res.t_s * kf, mono.t_s), mono_left) <= (max(res.t_s * kf, sol.t_s), left):
            sol, left = mono, mono_left
    if left and cfg.fill_tp:
        sol, left = _fill_idle(cluster, model, cfg, sol, left, hi_len)
    return _build_plan(cluster, cfg, tcost, st, res, sol, left, lo_len, hi_len, weights, t0)


def _fill_idle(cluster: ClusterSpec, model: ModelSpec, cfg: PlannerConfig, sol: RolloutSolution, left: int,
               hi_len) -> tuple[RolloutSolution, int]:
    """Spend GPUs the plan's own TPs cannot use (the rollout budget is not a multiple of them) on servers of
    a smaller TP from cfg.fill_tp, added to the slowest group's interval (same bucket) that their KV holds.
    The group's predicted time is kept (the extra servers only add capacity): the price stays conservative."""
    groups = list(sol.groups)
    for tp in sorted({t for t in cfg.fill_tp if t <= cluster.gpus_per_node}, reverse=True):
        if tp > left:
            continue
        cap = RolloutCost(cluster.hardware, model, tp, cfg.max_running).kv_capacity_tokens()
        fits = [i for i, g in enumerate(groups) if int(hi_len[g.hi - 1]) <= cap]
        if not fits:
            continue
        i = max(fits, key=lambda j: (groups[j].t_s, groups[j].hi))
        g = groups[i]
        k = left // tp
        same = next((j for j, h in enumerate(groups) if (h.tp, h.lo, h.hi) == (tp, g.lo, g.hi)), None)
        if same is not None:  # the slowest group already has this TP: just more servers
            h = groups[same]
            groups[same] = Group(tp, h.count + k, h.lo, h.hi, h.t_s, filler=True)
        else:
            groups.append(Group(tp, k, g.lo, g.hi, g.t_s, filler=True))
        left -= k * tp
    return RolloutSolution(sol.t_s, sum(g.gpus for g in groups), tuple(groups)), left


def _build_plan(cluster: ClusterSpec, cfg: PlannerConfig, tcost: TrainCost, st: BatchStats, res: TreeResult,
                sol: RolloutSolution, left: int, lo_len, hi_len, weights, t0: float) -> Plan:
    par: TrainParallel = res.best  # type: ignore[assignment]
    instances, intervals = [], []
    for grp in sol.groups:
        mn, mx = int(lo_len[grp.lo]), int(hi_len[grp.hi - 1])
        instances.append(RolloutInstance(grp.tp, grp.count, mx, mn, grp.t_s, filler=grp.filler))
        intervals.append(Interval(grp.lo, grp.hi, mn, mx, float(weights[grp.lo:grp.hi].sum()), grp.tp, grp.count,
                                  grp.t_s))
    notes = []
    if left:
        smallest = min(i.tp for i in instances)
        notes.append(f"{left} GPU(s) left idle: the smallest rollout server in the plan needs TP{smallest}, and "
                     f"{res.gpus} training GPUs gave a better step than any larger training layout")
    t_train, t_roll = res.t_s * cfg.train_factor, sol.t_s * cfg.rollout_factor
    return Plan(
        train=par,
        rollout_gpus=sol.gpus,
        instances=instances,
        t_train_s=t_train,
        t_rollout_s=t_roll,
        makespan_s=max(t_train, t_roll),
        solve_s=time.perf_counter() - t0,
        n_gpus=cluster.n_gpus,
        train_backend=cfg.train_backend,
        rollout_backend=cfg.rollout_backend,
        idle_gpus=left,
        notes=notes,
        tree_log=list(res.log),  # a copy: res is shared through _TREE_CACHE
        intervals=intervals,
        train_breakdown=tcost.breakdown(par, st),
    )
