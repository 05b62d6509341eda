"""Rollout DP: assign contiguous intervals of the length-sorted request sample to groups of identical
servers (one TP degree per interval, k servers sharing it evenly) minimising the rollout makespan
max_interval cost(tp, k, interval) under a GPU budget.

Equivalent to the (GPUs used, requests covered) table dp[g][i] = min over tp, k, c of
max(dp[g - k*tp][i - c], cost(tp, k, req[i-c:i])), computed in its dual form: for a makespan target T the
fewest GPUs covering the first i requests is a shortest path over i (each interval takes, per TP, the
fewest servers that meet T, found by binary search since cost falls with k), and the optimum is the
smallest candidate T (every achievable T is one of the tabulated costs) whose GPU count fits — exact,
and O(|TP| * n^2 * log G) per probe instead of O(G^2 * n^2 * |TP|).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from areal_libra.cost.rollout import RolloutCost

NATIVE_API = 2
try:  # the C++ probe (csrc/rollout_dp.cpp); the numpy version below gives identical results
    from areal_libra import _rollout_dp as _native
except ImportError:  # no compiler at install time
    _native = None
if _native is not None and getattr(_native, "API", 0) != NATIVE_API:  # a stale build from older sources
    _native = None


@dataclass(frozen=True)
class Group:
    """k servers of TP `tp` serving sample requests [lo, hi) (indices in length order)."""

    tp: int
    count: int
    lo: int
    hi: int
    t_s: float
    filler: bool = False  # added on GPUs the plan's TPs could not use (solve._fill_idle)

    @property
    def gpus(self) -> int:
        return self.tp * self.count


@dataclass(frozen=True)
class RolloutSolution:
    t_s: float
    gpus: int
    groups: tuple[Group, ...]


class RolloutDP:
    """Precomputes cost(tp, k, interval) for every interval of the sorted sample and k <= max_gpus/tp.

    prompts/outputs: the sample, sorted by final length (prompt + output) ascending; weights: how many real
    requests of one rollout batch each sample stands for.
    """

    def __init__(self, costs: dict[int, RolloutCost], prompts: Sequence[float], outputs: Sequence[float],
                 weights: Sequence[float], max_gpus: int, native: bool = True, window: float = 1.0,
                 reprefill: bool = True, slot_output: float | None = None, slot_wait_s: float = 0.0,
                 length_biased: bool = False, step_s: float = 0.0) -> None:
        self.native = native
        self.window = window  # RolloutCost.group_makespan_s: > 1 prices asynchronous, staleness-bounded rollout
        self.reprefill = reprefill
        # async in-flight slots, and the loop's step interval (group_makespan_s `step_s`)
        self.slot = {"slot_output": slot_output, "slot_wait_s": slot_wait_s, "step_s": step_s}
        self.costs = dict(sorted(costs.items()))
        self.p = np.asarray(prompts, dtype=float)
        self.o = np.asarray(outputs, dtype=float)
        self.w = np.asarray(weights, dtype=float)
        f = self.p + self.o
        if len(self.p) == 0:
            raise ValueError("the rollout DP needs at least one request")
        if np.any(np.diff(f) < 0):
            raise ValueError("requests must be sorted by final length")
        self.n = n = len(self.p)
        self.max_gpus = max_gpus
        # Flat interval index for [a, b): b(b-1)/2 + a, so the intervals ending at b are one slice.
        a_idx = np.concatenate([np.arange(b) for b in range(1, n + 1)])
        b_idx = np.concatenate([np.full(b, b) for b in range(1, n + 1)])
        self.a_idx, self.b_idx = a_idx, b_idx
        cw = np.concatenate([[0.0], np.cumsum(self.w)])
        cwp = np.concatenate([[0.0], np.cumsum(self.w * self.p)])
        cwo = np.concatenate([[0.0], np.cumsum(self.w * self.o)])
        W = cw[b_idx] - cw[a_idx]
        self.W = W
        self.mean_p = (cwp[b_idx] - cwp[a_idx]) / W
        self.mean_o = (cwo[b_idx] - cwo[a_idx]) / W
        self.mean_f = self.mean_p + self.mean_o
        if length_biased:  # resident generated tokens of a running request: E[o^2] / 2E[o] (length-biased)
            cwo2 = np.concatenate([[0.0], np.cumsum(self.w * self.o * self.o)])
            mo2 = (cwo2[b_idx] - cwo2[a_idx]) / W
            self.slot["resident_output"] = np.where(self.mean_o > 0, mo2 / np.maximum(2.0 * self.mean_o, 1e-9), 0.0)
        max_o = np.empty_like(W)
        for b in range(1, n + 1):  # suffix maxima of outputs ending at b
            s = b * (b - 1) // 2
            max_o[s:s + b] = np.maximum.accumulate(self.o[:b][::-1])[::-1]
        self.max_o = max_o
        self.max_f = f[b_idx - 1]  # sorted by final length: the last one is the longest
        # cost tables [grid index, interval], inf where the longest request exceeds the server's KV capacity.
        # Beyond ceil(W) servers an interval has less than one request per server: cost stays flat.
        self.tables: dict[int, np.ndarray] = {}
        self.kgrid: dict[int, np.ndarray] = {}
        self._caps = {tp: rc.kv_capacity_tokens() for tp, rc in self.costs.items()}
        kmax_useful = max(1, math.ceil(float(cw[-1]) - 1e-9))
        for tp, rc in self.costs.items():
            K = min(max_gpus // tp, kmax_useful)
            if K < 1:
                continue
            ok = self.max_f <= self._caps[tp]
            if not ok.any():
                continue
            grid = k_grid(K)
            self.kgrid[tp] = grid
            ks = grid.astype(float)[:, None]
            n_req = np.maximum(W[None, :] / ks, np.minimum(1.0, W)[None, :])
            tab = rc.group_makespan_s(n_req, self.mean_p[None, :], self.mean_o[None, :], self.max_o[None, :],
                                      self.max_f[None, :], window=window, reprefill=reprefill, **self._slot(None))
            tab = np.where(ok[None, :], tab, np.inf)
            tab = np.minimum.accumulate(tab, axis=0)  # guard monotonicity in k against float noise
            self.tables[tp] = np.ascontiguousarray(tab)
        self._cols = np.arange(len(W))

    def _slot(self, j: int | None) -> dict:
        """The slot and resident-KV arguments of group_makespan_s for interval j (all intervals: None)."""
        out = dict(self.slot)
        res = out.get("resident_output")
        if res is not None:
            out["resident_output"] = res[None, :] if j is None else float(res[j])
        return out

    # ---------------------------------------------------------------- probes
    def value_range(self) -> tuple[float, float] | None:
        """Smallest and largest finite cost in the tables (None if no server type can serve anything)."""
        if hasattr(self, "_range"):
            return self._range
        vals = [(float(t[np.isfinite(t)].min()), float(t[np.isfinite(t)].max()))
                for t in self.tables.values() if np.isfinite(t).any()]
        self._range = (min(v[0] for v in vals), max(v[1] for v in vals)) if vals else None
        return self._range

    def candidates_between(self, lo: float, hi: float) -> np.ndarray:
        """Sorted distinct table costs c with lo < c <= hi: the only makespans a solution can have there."""
        parts = [t[(t > lo) & (t <= hi)] for t in self.tables.values()]
        return np.unique(np.concatenate(parts)) if parts else np.empty(0)

    def _servers_needed(self, tp: int, T: float) -> np.ndarray:
        """Per interval: index into the server-count grid of the fewest servers of this TP with cost <= T
        (len(grid) where even the largest count misses T)."""
        tab = self.tables[tp]
        K = tab.shape[0]
        lo = np.zeros(len(self._cols), dtype=np.int64)  # index into k-1
        hi = np.full(len(self._cols), K, dtype=np.int64)  # K means "none"
        while True:
            active = lo < hi
            if not active.any():
                break
            mid = (lo + hi) // 2
            midc = np.minimum(mid, K - 1)
            ok = tab[midc, self._cols] <= T
            hi = np.where(active & ok, mid, hi)
            lo = np.where(active & ~ok, mid + 1, lo)
        return lo

    def min_gpus(self, T: float) -> tuple[float, list[tuple[int, int, int, int]] | None]:
        """Fewest GPUs whose groups all finish within T, and the groups [(a, b, tp, k)] (None if impossible)."""
        if self.native and _native is not None:
            g, groups = _native.min_gpus(list(self.tables.values()), [self.kgrid[tp] for tp in self.tables],
                                         list(self.tables), float(T), self.n)
            return float(g), (None if groups is None else [tuple(x) for x in groups])
        return self.min_gpus_py(T)

    def min_gpus_py(self, T: float) -> tuple[float, list[tuple[int, int, int, int]] | None]:
        """Pure numpy version of `min_gpus`."""
        M = len(self._cols)
        best_g = np.full(M, np.inf)
        best_tp = np.zeros(M, dtype=np.int64)
        best_k = np.zeros(M, dtype=np.int64)
        for tp in self.tables:
            idx = self._servers_needed(tp, T)
            grid = self.kgrid[tp]
            k = grid[np.minimum(idx, len(grid) - 1)]
            g = np.where(idx < len(grid), (k * tp).astype(float), np.inf)
            better = g < best_g  # ties keep the smaller TP (more replicas, more throughput per GPU)
            best_g = np.where(better, g, best_g)
            best_tp = np.where(better, tp, best_tp)
            best_k = np.where(better, k, best_k)
        n = self.n
        f = np.full(n + 1, np.inf)
        f[0] = 0.0
        arg = np.zeros(n + 1, dtype=np.int64)
        for b in range(1, n + 1):
            s = b * (b - 1) // 2
            tot = f[:b] + best_g[s:s + b]
            a = int(np.argmin(tot))
            f[b], arg[b] = tot[a], a
        if not np.isfinite(f[n]):
            return math.inf, None
        groups = []
        b = n
        while b > 0:
            a = int(arg[b])
            j = b * (b - 1) // 2 + a
            groups.append((a, b, int(best_tp[j]), int(best_k[j])))
            b = a
        return float(f[n]), groups[::-1]

    def cost(self, tp: int, k: int, a: int, b: int) -> float:
        """cost(tp, k servers, requests [a, b)): the table entry when k is on the grid, else the formula."""
        tab = self.tables.get(tp)
        if tab is None or k < 1:
            return math.inf
        j = b * (b - 1) // 2 + a
        grid = self.kgrid[tp]
        pos = int(np.searchsorted(grid, k))
        if pos < len(grid) and grid[pos] == k:
            return float(tab[pos, j])
        if self.max_f[j] > self._caps[tp]:
            return math.inf
        n_req = max(self.W[j] / k, min(1.0, self.W[j]))
        # Off the grid (above `dense` servers, or past its end when `fill` adds servers): the same objective
        # as the table, window and re-prefill included, and never above the grid point below (the table's
        # monotonicity guard).
        c = float(self.costs[tp].group_makespan_s(n_req, self.mean_p[j], self.mean_o[j], self.max_o[j],
                                                  self.max_f[j], window=self.window, reprefill=self.reprefill,
                                                  **self._slot(j)))
        return min(c, float(tab[pos - 1, j])) if pos > 0 else c

    def solution(self, groups: list[tuple[int, int, int, int]]) -> RolloutSolution:
        gs = tuple(Group(tp, k, a, b, self.cost(tp, k, a, b)) for a, b, tp, k in groups)
        return RolloutSolution(max(g.t_s for g in gs), sum(g.gpus for g in gs), gs)

    def best_within(self, budget: int, monotone: bool = False) -> RolloutSolution | None:
        """The minimum-makespan solution using at most `budget` GPUs (None if none exists). With `monotone`,
        among the equally cheap ways to meet that makespan the one whose TP rises with length is taken."""
        rng = self.value_range()
        if rng is None or self.min_gpus(rng[1])[0] > budget:
            return None
        T = smallest_feasible(lambda T: self.min_gpus(T)[0] <= budget, rng[0] / 2, rng[1], self.candidates_between)
        _, groups = self.monotone_groups(T) if monotone else self.min_gpus(T)
        return self.solution(groups)

    def monotone_groups(self, T: float) -> tuple[float, list[tuple[int, int, int, int]] | None]:
        """Like `min_gpus(T)` (same fewest GPUs), breaking ties by the fewest places where a longer interval
        gets a smaller TP than the interval before it — so buckets grow in TP with length when that is free.
        A shortest path over (requests covered, TP of the last interval) with key gpus * (n+1) + inversions."""
        n, tps = self.n, list(self.tables)
        nt = len(tps)
        M = len(self._cols)
        G = np.full((nt, M), np.inf)
        Ks = np.zeros((nt, M), dtype=np.int64)
        for i, tp in enumerate(tps):
            idx = self._servers_needed(tp, T)
            grid = self.kgrid[tp]
            k = grid[np.minimum(idx, len(grid) - 1)]
            G[i] = np.where(idx < len(grid), (k * tp).astype(float), np.inf)
            Ks[i] = k
        scale = float(n + 1)
        F = np.full((n + 1, nt), np.inf)  # best key ending at b with last TP index t
        arg = np.zeros((n + 1, nt, 2), dtype=np.int64)  # (a, previous TP index or -1)
        penalty = (np.arange(nt)[None, :] > np.arange(nt)[:, None]).astype(float)  # [t, t'] = 1 if t < t'
        for b in range(1, n + 1):
            s = b * (b - 1) // 2
            for t in range(nt):
                g = G[t, s:s + b] * scale  # over a = 0..b-1
                best, choice = g[0], (0, -1)  # a = 0: the first interval, nothing before it
                if b > 1:
                    cand = F[1:b, :] + penalty[t][None, :] + g[1:, None]  # [a-1, t']
                    j = int(np.argmin(cand))
                    a1, tprev = divmod(j, nt)
                    if cand[a1, tprev] < best:
                        best, choice = cand[a1, tprev], (a1 + 1, tprev)
                F[b, t] = best
                arg[b, t] = choice
        t = int(np.argmin(F[n]))
        if not np.isfinite(F[n, t]):
            return math.inf, None
        groups, b = [], n
        while b > 0:
            a, tprev = (int(x) for x in arg[b, t])
            j = b * (b - 1) // 2 + a
            groups.append((a, b, tps[t], int(Ks[t, j])))
            b, t = a, tprev
        groups.reverse()
        return float(sum(tp * k for _, _, tp, k in groups)), groups

    def fill(self, sol: RolloutSolution, budget: int) -> tuple[RolloutSolution, int]:
        """Spend leftover GPUs on extra servers for the slowest groups (cost never rises with k); returns the
        solution and the GPUs that could not be placed."""
        groups = list(sol.groups)
        left = budget - sol.gpus
        while left > 0:
            options = [i for i, g in enumerate(groups) if g.tp <= left]
            if not options:
                break
            new = {i: self.cost(groups[i].tp, groups[i].count + 1, groups[i].lo, groups[i].hi) for i in options}
            # the slowest group that an extra server speeds up; if none, the slowest (budget is spent anyway)
            improving = [i for i in options if new[i] < groups[i].t_s]
            i = max(improving or options, key=lambda j: (groups[j].t_s, -groups[j].tp))
            g = groups[i]
            groups[i] = Group(g.tp, g.count + 1, g.lo, g.hi, new[i])
            left -= g.tp
        return RolloutSolution(max(g.t_s for g in groups), sum(g.gpus for g in groups), tuple(groups)), left



def k_grid(kmax: int, dense: int = 64, step: float = 1.0625) -> np.ndarray:
    """Server counts the DP considers for one group: every count up to `dense`, then steps of ~6% up to
    kmax (keeps the cost table small on 1,000-GPU clusters; leftover GPUs are added back by `fill`)."""
    ks = list(range(1, min(kmax, dense) + 1))
    while ks[-1] < kmax:
        ks.append(min(kmax, max(ks[-1] + 1, math.ceil(ks[-1] * step))))
    return np.array(ks, dtype=np.int64)


def smallest_feasible(feasible: Callable[[float], bool], lo: float, hi: float,
                      between: Callable[[float, float], np.ndarray], rel: float = 1e-3) -> float:
    """Smallest candidate T in (lo, hi] with feasible(T), for a monotone `feasible` that can change only at
    candidate values, given feasible(hi) and not feasible(lo). A geometric bisection first narrows the
    window to a ratio of 1 + rel (cheap: no candidate list), then an exact bisection runs over the
    candidates left in the window — avoiding a sort of every tabulated cost."""
    while hi > lo * (1.0 + rel):
        mid = math.sqrt(lo * hi) if lo > 0 else hi / 2.0
        if feasible(mid):
            hi = mid
        else:
            lo = mid
    vals = between(lo, hi)
    # feasible is constant between candidates, so the largest candidate <= hi is feasible like hi itself.
    i, j = 0, len(vals) - 1
    while i < j:
        m = (i + j) // 2
        if feasible(float(vals[m])):
            j = m
        else:
            i = m + 1
    return float(vals[i])
