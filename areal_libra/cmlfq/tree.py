"""Causal prefix tree (docs/cmlfq.md): a root per prompt id plus a global root; a node per ordered sequence
of tool-return states; each node keeps the distribution of remaining length (final length minus the
context at that decision point): total count, and mean / nearest-rank P90 over the last `window` samples.

The hot path runs in C++ (areal_libra._prefix_tree, built from csrc/prefix_tree.cpp) when it is built,
else in the pure-Python core; both give identical results (tests/cmlfq/test_prefix_tree_backends.py). A
policy decision is one call (request_decider): the rule, the switches and the drift/growth state are
installed in the core beforehand (set_rule, set_scaling), never per decision.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from areal_libra.cmlfq._pytree import PyTreeCore
from areal_libra.cmlfq.drift import GrowthTable, LengthDrift
from areal_libra.cmlfq.states import SizeClasses, ToolState, tool_state
from areal_libra.trace import ToolReturn, Trajectory
from areal_libra.utils import atomic_write_bytes

try:  # the C++ core is optional: no compiler is a supported configuration
    from areal_libra import _prefix_tree as _cpp  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on the build
    _cpp = None

log = logging.getLogger(__name__)

FORMAT = "areal_libra.prefix_tree"
VERSION = 1


class TreeFileError(ValueError):
    """A tree file that cannot be used (missing, truncated, corrupted, wrong version)."""


@dataclass(frozen=True)
class NodeStats:
    mean: float
    p90: int
    count: int
    depth: int
    from_global: bool
    pq: int = 0  # the quantile asked for in lookup(q=...), P50 by default


def cpp_available() -> bool:
    return _cpp is not None


def decision_contexts(traj: Trajectory) -> list[int]:
    """Context length at each decision point: the start, then after each tool return."""
    ctx = traj.prompt_tokens
    out = [ctx]
    for s in traj.segments:
        ctx += s.gen_tokens
        if s.tool is not None:
            ctx += s.tool.payload_tokens
            out.append(ctx)
    return out


class PrefixTree:
    def __init__(self, min_samples: int = 4, window: int = 200, max_nodes: int = 200_000,
                 sizes: SizeClasses = SizeClasses(), backend: str = "auto") -> None:
        if backend not in ("auto", "cpp", "python"):
            raise ValueError(f"backend must be auto, cpp or python, got {backend!r}")
        if backend == "cpp" and _cpp is None:
            raise RuntimeError("C++ prefix tree not built (pip install -e . with a C++ compiler)")
        self.backend = "cpp" if backend in ("auto", "cpp") and _cpp is not None else "python"
        self.min_samples, self.window, self.max_nodes, self.sizes = min_samples, window, max_nodes, sizes
        core_cls = _cpp.TreeCore if self.backend == "cpp" else PyTreeCore
        self._core = core_cls(min_samples, window, max_nodes)
        if self.backend == "cpp":
            self._core.set_sizes(sizes.small, sizes.medium)  # the core's own return-state cache key
            self._core.set_resolver(weakref.WeakMethod(self.resolve_return))  # for its cache misses
        self._ids: dict[ToolState, int] = {}
        self._states: list[ToolState] = []
        self._state_map: Callable[[ToolState], ToolState] | None = None
        # (tool name, size class index, raw status) -> state id, for the per-decision fast path.
        self._rcache: dict[tuple[str, int, str], int] = {}

    @property
    def state_map(self) -> Callable[[ToolState], ToolState] | None:
        """Optional coarsening of states before they key the tree (the policy's state_key switch)."""
        return self._state_map

    @state_map.setter
    def state_map(self, fn: Callable[[ToolState], ToolState] | None) -> None:
        self._state_map = fn
        self._clear_rcache()

    def _clear_rcache(self) -> None:
        self._rcache.clear()
        if self.backend == "cpp":
            self._core.clear_return_cache()

    # --- state interning: both backends see the same small integers ---
    def state_id(self, st: ToolState) -> int:
        i = self._ids.get(st)
        if i is None:
            i = len(self._states)
            self._ids[st] = i
            self._states.append(st)
        return i

    def state_ids(self, states: Sequence[ToolState]) -> list[int]:
        # Unknown states cannot match any node: give them -2 instead of growing the table on lookups.
        get = self._ids.get
        return [get(s, -2) for s in states]

    def return_ids(self, tools: Sequence[ToolReturn]) -> list[int]:
        """State ids of raw tool returns without building ToolState objects once a state is known."""
        cache, small, medium = self._rcache, self.sizes.small, self.sizes.medium
        out = []
        for t in tools:
            p = t.payload_tokens
            key = (t.name, 0 if p <= small else (1 if p <= medium else 2), t.status)
            i = cache.get(key)
            if i is None:
                i = self.resolve_return(t)
                if i >= 0:  # unknown states may appear later: do not cache them
                    cache[key] = i
            out.append(i)
        return out

    def resolve_return(self, tool: ToolReturn) -> int:
        """State id of one raw tool return (-2: a state the tree has never seen)."""
        st = tool_state(tool, self.sizes)
        return self._ids.get(st if self._state_map is None else self._state_map(st), -2)

    # --- hot path ---
    def insert(self, traj: Trajectory, scale: float = 1.0) -> None:
        """Insert a finished trajectory. scale != 1 stores remaining lengths divided by it (rounded): the
        policy's drift switch keeps the tree in units of a reference length level."""
        sm = self.state_map
        ids = [self.state_id(tool_state(t, self.sizes) if sm is None else sm(tool_state(t, self.sizes)))
               for t in traj.tool_returns()]
        final = traj.final_length
        remaining = [max(0, final - c) for c in decision_contexts(traj)]
        if scale != 1.0:
            remaining = [int(round(r / scale)) for r in remaining]
        self._core.insert(traj.prompt_id, ids, remaining)

    def lookup(self, prompt_id: str, states: Sequence[ToolState], q: float = 0.5,
               floors: Sequence[int] | None = None, prompt_first: bool = False) -> NodeStats:
        """Deepest matching node with enough samples (prompt's own subtree first, else the global one).
        floors[d] = how far the trajectory grew past its decision point at depth d: a node shallower than
        the query then reports the remaining length of its samples that grew at least that far."""
        return NodeStats(*self._core.lookup(prompt_id, self.state_ids(states), q, list(floors or ()), prompt_first))

    def lookup_ids(self, prompt_id: str, ids: list[int], q: float = 0.5, floors: list[int] | None = None,
                   prompt_first: bool = False) -> tuple[float, int, int, int, bool, int]:
        """Raw lookup on pre-interned ids (the policy's fast path)."""
        return self._core.lookup(prompt_id, ids, q, floors or [], prompt_first)

    def set_rule(self, thresholds: Sequence[float], use_mean: bool, q: float, overrun: bool,
                 condition: bool, prompt_first: bool) -> None:
        """Install the C-MLFQ bucket rule in the core (policy.CMLFQPolicy does this)."""
        self._rule = (list(map(float, thresholds)), use_mean, q, overrun, condition, prompt_first)
        self._core.set_rule(*self._rule)

    def growth_table(self) -> GrowthTable:
        """An empty growth table of this tree's backend (the C++ core reads only its own kind)."""
        return _cpp.GrowthCore() if self.backend == "cpp" else GrowthTable()

    def accepts_growth(self, table: object) -> bool:
        return isinstance(table, _cpp.GrowthCore) if self.backend == "cpp" else isinstance(table, GrowthTable)

    def set_scaling(self, drift: LengthDrift | None, growth: GrowthTable | None, growth_exp: float) -> None:
        """Install the policy's drift and growth switches in the core (once per step boundary, not per
        decision): each decision's multiplier on the remaining lengths is computed there from them."""
        if growth is not None and not self.accepts_growth(growth):
            raise TypeError(f"growth table {type(growth).__name__} does not fit the {self.backend} tree core")
        on = drift is not None
        ref = drift.ref if on and drift.ref is not None else None
        self._core.set_scaling(on, drift.rate if on else 0.0, ref is not None, 0 if ref is None else ref,
                               bool(on and drift.past_ok), growth, float(growth_exp))

    def decide(self, prompt_id: str, ids: list[int], ctx: int, dctx: Sequence[int], current: int,
               placing: bool = False, step: int = 0, depth: int | None = None, prompt_tokens: int = 0
               ) -> tuple[int, bool, float]:
        """One C-MLFQ decision in the core: (bucket, whether the global subtree answered, predicted remaining
        length past `ctx` in the request's tokens: what the policy's migration price reads). The core scales
        the request (set_scaling: drift level of `step`, growth at `depth` tool returns of its context past
        `prompt_tokens`; depth defaults to len(ids)), then divides the contexts (rounded) and the thresholds
        by that multiplier so the rule runs in the tree's units."""
        return self._core.decide(prompt_id, ids, ctx, dctx, current, placing, step,
                                 len(ids) if depth is None else depth, prompt_tokens)

    def decide_request(self, req, current: int, placing: bool = False) -> tuple[int, bool, float]:
        """decide() for a policy.RequestInfo: its tool returns mapped to state ids (none when placing),
        growth read at its depth. The C++ core does all of it in one call (request_decider)."""
        ids = [] if placing else self.return_ids(req.tool_returns)
        return self._core.decide(req.prompt_id, ids, req.context_tokens, req.decision_contexts, current, placing,
                                 req.step, len(req.tool_returns), req.prompt_tokens)

    def request_decider(self) -> Callable[[object, int, bool], tuple[int, bool, float]]:
        """decide_request as one callable for the policy's per-decision path: with the C++ core a single
        call into C++ (request fields, return-state cache, scaling, lookup, rule), else the Python path."""
        return self._core.decide_request if self.backend == "cpp" else self.decide_request

    def request_scale(self, prompt_id: str, step: int, depth: int, ctx: int, prompt_tokens: int) -> float:
        """The multiplier a decision applies (for tests and diagnostics)."""
        return self._core.scale(prompt_id, step, depth, ctx, prompt_tokens)

    def rebuild(self, trajs: Iterable[Trajectory], scale_of: Callable[[Trajectory], float] | None = None) -> None:
        """Forget everything and re-insert `trajs` in order (the caller bounds the window); scale_of(traj)
        gives each one's insert scale (default 1)."""
        self._core.clear()
        self._ids.clear()
        self._states.clear()
        self._clear_rcache()
        for t in trajs:
            self.insert(t, 1.0 if scale_of is None else scale_of(t))

    def clear(self) -> None:
        self._core.clear()

    def node_count(self) -> int:
        return self._core.node_count()

    def dump(self) -> dict:
        return self._core.dump()

    # --- persistence ---
    def _body(self) -> dict:
        return {
            "params": {"min_samples": self.min_samples, "window": self.window, "max_nodes": self.max_nodes,
                       "sizes": [self.sizes.small, self.sizes.medium]},
            "states": [[s.tool, s.size_class, s.status] for s in self._states],
            "core": self._core.dump(),
        }

    def save(self, path: str | os.PathLike) -> None:
        """Atomic write: a header line (format, version, sha256 and length of the body), then the body."""
        body = json.dumps(self._body(), separators=(",", ":")).encode()
        header = {"format": FORMAT, "version": VERSION, "sha256": hashlib.sha256(body).hexdigest(),
                  "bytes": len(body)}
        atomic_write_bytes(path, json.dumps(header).encode() + b"\n" + body)

    @classmethod
    def load(cls, path: str | os.PathLike, backend: str = "auto") -> PrefixTree:
        p = Path(path)
        try:
            raw = p.read_bytes()
        except OSError as e:
            raise TreeFileError(f"{p}: cannot read tree file ({e.strerror or e})") from None
        head, sep, body = raw.partition(b"\n")
        if not sep and head.startswith(b'{"format"'):
            raise TreeFileError(f"{p}: truncated tree file (no complete header line)")
        try:
            header = json.loads(head)
        except (ValueError, UnicodeDecodeError):
            raise TreeFileError(f"{p}: not a prefix-tree file (bad header line)") from None
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise TreeFileError(f"{p}: not a prefix-tree file (format field is not {FORMAT!r})")
        if header.get("version") != VERSION:
            raise TreeFileError(f"{p}: tree file version {header.get('version')!r}, this build reads {VERSION}")
        if not sep or len(body) != header.get("bytes"):
            raise TreeFileError(f"{p}: truncated tree file ({len(body)} of {header.get('bytes')} body bytes)")
        if hashlib.sha256(body).hexdigest() != header.get("sha256"):
            raise TreeFileError(f"{p}: corrupted tree file (checksum mismatch)")
        try:
            d = json.loads(body)
            prm = d["params"]
            tree = cls(int(prm["min_samples"]), int(prm["window"]), int(prm["max_nodes"]),
                       SizeClasses(*prm["sizes"]), backend=backend)
            for tool, size, status in d["states"]:
                tree.state_id(ToolState(tool, size, status))
            tree._core.restore(d["core"])
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise TreeFileError(f"{p}: malformed tree body ({type(e).__name__}: {e})") from None
        return tree

    @classmethod
    def load_or_empty(cls, path: str | os.PathLike, **kwargs) -> PrefixTree:
        """The live path: a missing or broken file gives an empty tree and a warning, never a crash."""
        try:
            return cls.load(path, backend=kwargs.get("backend", "auto"))
        except TreeFileError as e:
            log.warning("prefix tree: %s; starting from an empty tree", e)
            return cls(**kwargs)
