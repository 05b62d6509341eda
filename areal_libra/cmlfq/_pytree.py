"""Pure-Python core of the causal prefix tree. Same algorithm, same numbers as csrc/prefix_tree.cpp.

The core speaks integer state ids (interned by PrefixTree). Every operation advances a tick and stamps
the nodes it walks; eviction removes whole subtrees in (tick, serial) order, so both backends evict the
same nodes. Mean is sum/n over the window; P90 and P_q are nearest-rank values of the window.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import deque
from itertools import accumulate

from areal_libra.cmlfq.drift import GrowthTable, growth_factor, routed_level


class _Node:
    __slots__ = ("serial", "parent", "state", "depth", "prompt", "children", "count", "win", "wsum",
                 "tick", "q")

    def __init__(self, serial: int, parent: _Node | None, state: int, depth: int, prompt: str | None,
                 window: int) -> None:
        self.serial = serial
        self.parent = parent
        self.state = state
        self.depth = depth
        self.prompt = prompt  # set on prompt roots only
        self.children: dict[int, _Node] = {}
        self.count = 0
        self.win: deque[int] = deque(maxlen=window)
        self.wsum = 0
        self.tick = 0
        self.q: tuple[list[int], list[int]] | None = None  # cached sorted window + prefix sums

    def add(self, value: int) -> None:
        if len(self.win) == self.win.maxlen:
            self.wsum -= self.win[0]
        self.win.append(value)
        self.wsum += value
        self.count += 1
        self.q = None

    def stats(self, q: float, floor: int) -> tuple[float, int, int]:
        """(mean, P_q, P90) of the window samples >= floor (all of them for floor <= 0): the remaining
        length given that the trajectory already grew `floor` tokens past this node. Quantiles are
        nearest-rank: sorted[ceil(q * n) - 1]. No sample that large: all three are `floor`."""
        n = len(self.win)
        if n == 0:
            return 0.0, 0, 0
        if self.q is None:
            w = sorted(self.win)
            self.q = (w, list(accumulate(w, initial=0)))
        w, pre = self.q
        lo = bisect_left(w, floor) if floor > 0 else 0
        m = n - lo
        if m == 0:
            return float(floor), floor, floor
        return (pre[n] - pre[lo]) / m, w[lo + _rank(q, m)], w[lo + (9 * m + 9) // 10 - 1]


def _floor(floors: list[int] | None, depth: int) -> int:
    return floors[depth] if floors and depth < len(floors) else 0


def _rank(q: float, n: int) -> int:
    # Same double arithmetic as the C++ core: ceil(q * n) - 1, clamped to the window.
    return min(n - 1, max(0, math.ceil(q * n) - 1))


class PyTreeCore:
    def __init__(self, min_samples: int, window: int, max_nodes: int) -> None:
        if window < 1 or min_samples < 1 or max_nodes < 2:
            raise ValueError("need window >= 1, min_samples >= 1, max_nodes >= 2")
        self.min_samples = min_samples
        self.window = window
        self.max_nodes = max_nodes
        self.rule: tuple | None = None
        self.set_scaling(False, 0.0, False, 0, False, None, 0.0)
        self.clear()

    def clear(self) -> None:
        self.tick = 0
        self.serial = 0
        self.nodes: dict[int, _Node] = {}
        self.prompts: dict[str, _Node] = {}
        self.root = self._new(None, -1, None)

    def _new(self, parent: _Node | None, state: int, prompt: str | None) -> _Node:
        n = _Node(self.serial, parent, state, 0 if parent is None else parent.depth + 1, prompt, self.window)
        self.serial += 1
        self.nodes[n.serial] = n
        return n

    def node_count(self) -> int:
        return len(self.nodes)

    def _insert_path(self, node: _Node, states: list[int], remaining: list[int]) -> None:
        node.tick = self.tick
        node.add(remaining[0])
        for s, r in zip(states, remaining[1:]):
            child = node.children.get(s)
            if child is None:
                child = self._new(node, s, None)
                node.children[s] = child
            node = child
            node.tick = self.tick
            node.add(r)

    def insert(self, prompt: str, states: list[int], remaining: list[int]) -> None:
        """remaining[k] = remaining length after the k-th tool return (k = 0: at start)."""
        if len(remaining) != len(states) + 1:
            raise ValueError("remaining must have one more entry than states")
        self.tick += 1
        self._insert_path(self.root, states, remaining)
        proot = self.prompts.get(prompt)
        if proot is None:
            proot = self._new(None, -1, prompt)
            self.prompts[prompt] = proot
        self._insert_path(proot, states, remaining)
        if len(self.nodes) > self.max_nodes:
            self._evict()

    def _walk(self, node: _Node, states: list[int]) -> _Node | None:
        node.tick = self.tick
        best = node if node.count >= self.min_samples else None
        for s in states:
            node = node.children.get(s)
            if node is None:
                break
            node.tick = self.tick
            if node.count >= self.min_samples:
                best = node
        return best

    def lookup(self, prompt: str, states: list[int], q: float = 0.5, floors: list[int] | None = None,
               prompt_first: bool = False) -> tuple[float, int, int, int, bool, int]:
        """(mean, p90, count, depth, from_global, P_q) of the deepest matching node with enough samples.
        floors[d]: how far the trajectory has grown past its decision point at depth d (conditions the
        statistics of a node shallower than the query); None: no conditioning. prompt_first: the prompt's
        own deepest trusted node wins even when the global one is deeper."""
        self.tick += 1
        g = self._walk(self.root, states)
        proot = self.prompts.get(prompt)
        p = self._walk(proot, states) if proot is not None else None
        if p is not None and (prompt_first or g is None or p.depth >= g.depth):
            mean, pq, p90 = p.stats(q, _floor(floors, p.depth))
            return mean, p90, p.count, p.depth, False, pq
        node = g if g is not None else self.root
        mean, pq, p90 = node.stats(q, _floor(floors, node.depth))
        return mean, p90, node.count, node.depth, True, pq

    # --- the C-MLFQ bucket rule (documented in policy.py; csrc/prefix_tree.cpp mirrors it) ---
    def set_rule(self, thresholds: list[float], use_mean: bool, q: float, overrun: bool,
                 condition: bool, prompt_first: bool) -> None:
        if not thresholds:
            raise ValueError("need at least one bucket threshold")
        self.rule = (list(thresholds), use_mean, q, overrun, condition, prompt_first)

    def set_scaling(self, drift: bool, rate: float, has_ref: bool, ref: int, past_ok: bool,
                    growth: GrowthTable | None, growth_exp: float) -> None:
        """The request's multiplier on the tree's remaining lengths (the policy's drift and growth switches),
        installed once per step boundary (csrc/prefix_tree.cpp set_scaling)."""
        self.scaling = (drift and has_ref, rate, ref, past_ok, growth, growth_exp if growth is not None else 0.0)

    def scale(self, prompt: str, step: int, depth: int, ctx: int, prompt_tokens: int) -> float:
        drift, rate, ref, past_ok, growth, growth_exp = self.scaling
        scale = routed_level(rate, ref, past_ok, step) if drift else 1.0
        if growth_exp != 0 and depth > 0:
            scale *= growth_factor((ctx - prompt_tokens) / scale, growth.typical(prompt, depth), growth_exp)
        return scale

    def decide(self, prompt: str, ids: list[int], ctx: int, dctx: list[int], current: int, placing: bool,
               step: int, depth: int, prompt_tokens: int) -> tuple[int, bool, float]:
        """(bucket, from_global, predicted remaining length past ctx in the request's tokens: the mean's)."""
        th, use_mean, q, overrun, condition, prompt_first = self.rule
        scale = self.scale(prompt, step, depth, ctx, prompt_tokens) if self.scaling[0] or self.scaling[5] else 1.0
        if not scale > 0:
            raise ValueError("scale must be > 0")
        if scale != 1.0:  # contexts and thresholds in the tree's units (as the C++ core)
            th = [t / scale for t in th]
            ctx = round(ctx / scale)
            dctx = [round(c / scale) for c in dctx]
        last = len(th) - 1
        current = max(0, min(current, last))
        cond = condition and len(dctx) == len(ids) + 1
        floors = [ctx - c for c in dctx] if cond else None
        mean, p90, count, depth, from_global, pq = self.lookup(prompt, ids, 0.5 if use_mean else q, floors,
                                                               prompt_first and cond)
        if count == 0:
            return current, from_global, 0.0
        # Predicted final length = context at the node's decision point + its remaining length.
        base = float(dctx[depth] if cond else ctx)
        remaining = max(0.0, (base + mean) - float(ctx)) * scale
        b_center = min(bisect_left(th, base + (mean if use_mean else float(pq))), last)
        if placing:
            return b_center, from_global, remaining
        target = current
        if b_center == min(bisect_left(th, base + float(p90)), last):
            target = b_center
        elif overrun and float(ctx) > th[current]:
            target = b_center
        return target, from_global, remaining

    def _drop(self, node: _Node) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            del self.nodes[n.serial]
        if node.parent is not None:
            del node.parent.children[node.state]
        else:
            del self.prompts[node.prompt]

    def _evict(self) -> None:
        # Evict down to 90% of the cap so the sort is amortised over many inserts.
        low = self.max_nodes * 9 // 10
        order = sorted((n for n in self.nodes.values() if n is not self.root), key=lambda n: (n.tick, n.serial))
        for n in order:
            if len(self.nodes) <= low:
                break
            if n.serial in self.nodes:
                self._drop(n)

    # --- persistence: a flat list of node records, parents before children (serial order) ---
    def dump(self) -> dict:
        recs = []
        for serial in sorted(self.nodes):
            n = self.nodes[serial]
            recs.append([n.serial, -1 if n.parent is None else n.parent.serial, n.state, n.prompt, n.count,
                         list(n.win), n.tick])
        return {"tick": self.tick, "serial": self.serial, "nodes": recs}

    def restore(self, d: dict) -> None:
        self.tick = 0
        self.serial = 0
        self.nodes = {}
        self.prompts = {}
        self.root = None
        for serial, parent, state, prompt, count, win, tick in d["nodes"]:
            par = self.nodes[parent] if parent >= 0 else None
            n = _Node(serial, par, state, 0 if par is None else par.depth + 1, prompt, self.window)
            n.count = count
            for v in win[-self.window:]:
                n.win.append(int(v))
            n.wsum = sum(n.win)
            n.tick = tick
            self.nodes[serial] = n
            if par is not None:
                par.children[state] = n
            elif prompt is None:
                self.root = n
            else:
                self.prompts[prompt] = n
        if self.root is None:
            raise ValueError("tree has no global root")
        self.tick = int(d["tick"])
        self.serial = int(d["serial"])
