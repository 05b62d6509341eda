"""The plug point between a routing policy and real servers (the live system and the simulator both use
it): route(meta) -> server address. Thread safe; all policy state changes happen under one lock.

A trajectory keeps its group until the policy moves it at a tool return (a request whose metadata
carries more tool returns than the dispatcher has seen for that trajectory). Within a group the
least-loaded healthy server wins; a group with no healthy server falls through to the next larger group
(then smaller ones).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace

from areal_libra.cmlfq.policy import LeastLoadedPolicy
from areal_libra.cmlfq.spill import SpillConfig, spill
from areal_libra.cmlfq.states import RequestInfo, as_tool_return
from areal_libra.trace import TraceError, Trajectory, parse_canonical


@dataclass
class ServerGroup:
    name: str
    tp: int
    max_len: int
    addresses: list[str] = field(default_factory=list)


@dataclass
class _TrajState:
    bucket: int  # the policy's decision
    group: int  # where it actually runs (differs only when a group has no healthy server)
    seen_tools: int
    server: str
    contexts: tuple[int, ...]  # context at the start and after each tool return seen so far


class NoHealthyServer(RuntimeError):
    pass


def request_from_meta(meta: dict) -> RequestInfo:
    """Build a RequestInfo from the dispatcher's metadata dict (tool returns as objects or dicts)."""
    try:
        tools = tuple(as_tool_return(t) for t in meta.get("tool_returns") or ())
        prompt_tokens = int(meta.get("prompt_tokens", 0))
        fl = meta.get("final_length")
        return RequestInfo(
            trajectory_id=str(meta["trajectory_id"]),
            prompt_id=str(meta.get("prompt_id", meta["trajectory_id"])),
            prompt_tokens=prompt_tokens,
            context_tokens=int(meta.get("context_tokens", prompt_tokens)),
            model_tokens=int(meta.get("model_tokens", 0)),
            tool_returns=tools,
            step=int(meta.get("step", 0)),
            final_length=None if fl is None else int(fl),
            decision_contexts=tuple(int(c) for c in meta.get("decision_contexts") or ()),
        )
    except KeyError as e:
        raise ValueError(f"routing metadata lacks {e.args[0]!r}") from None


class Dispatcher:
    def __init__(self, policy, groups: list[ServerGroup], sticky: bool = False,
                 spill: SpillConfig | None = None) -> None:
        if not groups:
            raise ValueError("Dispatcher needs at least one server group")
        self.groups = sorted(groups, key=lambda g: g.max_len)
        if len(policy.buckets) != len(self.groups):
            raise ValueError(f"policy has {len(policy.buckets)} buckets but there are {len(self.groups)} groups")
        self.policy = policy
        self.sticky = sticky  # keep a trajectory on its server inside a group (prefix-cache reuse)
        self.spill = spill  # load-aware spill-over between neighbouring groups on placements (None: off)
        self._lock = threading.RLock()
        self._traj: dict[str, _TrajState] = {}
        self._group_of: dict[str, int] = {}
        self._inflight: dict[str, int] = {}
        self._routed: dict[str, int] = {}
        self._unhealthy: set[str] = set()
        for gi, g in enumerate(self.groups):
            for a in g.addresses:
                if a in self._group_of:
                    raise ValueError(f"server {a} is listed in two groups")
                self._group_of[a] = gi
                self._inflight[a] = 0
                self._routed[a] = 0
        self.counters = {"routed": 0, "migrations": 0, "migrated_tokens": 0, "fallbacks": 0, "finished": 0,
                         "spills": 0}
        if isinstance(policy, LeastLoadedPolicy) and policy.load_fn is None:
            policy.load_fn = self._group_loads
        if hasattr(policy, "fallback_active") and policy.load_fn is None:
            policy.load_fn = self._gpu_loads  # C-MLFQ's least-loaded fallback and its move price
        self._set_bucket_gpus()

    def _set_bucket_gpus(self) -> None:
        """Healthy GPUs per group: the shares C-MLFQ's fallback verdict compares its accuracy with."""
        if hasattr(self.policy, "bucket_gpus"):
            self.policy.bucket_gpus = [sum(1 for a in g.addresses if a not in self._unhealthy) * max(1, g.tp)
                                       for g in self.groups]

    def _group_loads(self) -> list[float]:
        out = []
        for g in self.groups:
            healthy = [a for a in g.addresses if a not in self._unhealthy]
            out.append(sum(self._inflight[a] for a in healthy) / len(healthy) if healthy else float("inf"))
        return out

    def _gpu_loads(self) -> list[float]:
        """In-flight requests per healthy GPU of each group (what spill-over compares)."""
        out = []
        for g in self.groups:
            healthy = [a for a in g.addresses if a not in self._unhealthy]
            gpus = len(healthy) * max(1, g.tp)
            out.append(sum(self._inflight[a] for a in healthy) / gpus if gpus else float("inf"))
        return out

    def _pick(self, gi: int, prefer: str | None) -> tuple[int, str]:
        order = list(range(gi, len(self.groups))) + list(range(gi - 1, -1, -1))
        for g in order:
            healthy = [(i, a) for i, a in enumerate(self.groups[g].addresses) if a not in self._unhealthy]
            if not healthy:
                continue
            if g != gi:
                self.counters["fallbacks"] += 1
            if prefer is not None and any(a == prefer for _, a in healthy):
                return g, prefer
            _, addr = min(healthy, key=lambda ia: (self._inflight[ia[1]], self._routed[ia[1]], ia[0]))
            return g, addr
        raise NoHealthyServer("no healthy rollout server in any group")

    def route(self, meta: dict) -> str:
        req = request_from_meta(meta)
        with self._lock:
            st = self._traj.get(req.trajectory_id)
            n_tools = len(req.tool_returns)
            if st is None:
                contexts: tuple[int, ...] = (req.context_tokens,) if n_tools == 0 else ()
                bucket = self.policy.start(replace(req, decision_contexts=contexts or req.decision_contexts))
                if n_tools:  # first seen mid-trajectory (e.g. after a restart): no earlier contexts known
                    bucket = self.policy.tool_return(req, bucket)
            elif n_tools > st.seen_tools:
                contexts = st.contexts + (req.context_tokens,) if st.contexts else ()
                if len(contexts) != n_tools + 1:
                    contexts = ()
                bucket = self.policy.tool_return(replace(req, decision_contexts=contexts or req.decision_contexts),
                                                 st.bucket)
            else:
                contexts = st.contexts
                bucket = st.bucket
            bucket = max(0, min(int(bucket), len(self.groups) - 1))
            if self.spill is not None and (st is None or bucket != st.bucket):
                loads = self._gpu_loads()
                spilled = spill(bucket, loads, self.spill)
                if spilled != bucket:
                    self.counters["spills"] += 1
                    bucket = spilled
            # Sticky: stay on the same server while the group does not change (its prefix cache holds the
            # context); otherwise re-pick the least-loaded healthy server of the group on every request.
            prefer = st.server if (self.sticky and st is not None and bucket == st.bucket) else None
            group, addr = self._pick(bucket, prefer)
            if st is not None and group != st.group:
                self.counters["migrations"] += 1
                self.counters["migrated_tokens"] += req.context_tokens
            self._traj[req.trajectory_id] = _TrajState(bucket, group, max(n_tools, st.seen_tools if st else 0), addr,
                                                       contexts)
            self._routed[addr] += 1
            self.counters["routed"] += 1
            return addr

    def placement(self, trajectory_id: str) -> tuple[int, int] | None:
        """(bucket the policy chose, group it runs in) of an active trajectory, or None."""
        with self._lock:
            st = self._traj.get(trajectory_id)
            return None if st is None else (st.bucket, st.group)

    @property
    def lock(self) -> threading.RLock:
        """The lock that guards policy state: hold it to change the policy consistently (e.g. swap a
        rebuilt prefix tree in) while requests are being routed."""
        return self._lock

    # --- load accounting ---
    def begin(self, addr: str) -> None:
        with self._lock:
            if addr in self._inflight:
                self._inflight[addr] += 1

    def end(self, addr: str) -> None:
        with self._lock:
            if self._inflight.get(addr, 0) > 0:
                self._inflight[addr] -= 1

    acquire = begin
    release = end

    # --- membership (a hybrid replica's server comes and goes with the elastic pool) ---
    def add_server(self, addr: str, group: int) -> None:
        """Route to `addr` from now on, as a server of group index `group`."""
        with self._lock:
            if addr in self._group_of and addr in self.groups[self._group_of[addr]].addresses:
                raise ValueError(f"server {addr} is already in group {self.groups[self._group_of[addr]].name}")
            self.groups[group].addresses.append(addr)
            self._group_of[addr] = group
            self._inflight.setdefault(addr, 0)
            self._routed.setdefault(addr, 0)
            self._unhealthy.discard(addr)

    def remove_server(self, addr: str) -> bool:
        """No new request goes to `addr`; its in-flight ones still end normally (load accounting kept).
        A trajectory stuck to it moves on its next request. Returns whether it was a member."""
        with self._lock:
            gi = self._group_of.get(addr)
            if gi is None or addr not in self.groups[gi].addresses:
                return False
            self.groups[gi].addresses.remove(addr)
            return True

    # --- health ---
    def mark_unhealthy(self, addr: str) -> None:
        with self._lock:
            if addr in self._group_of:
                self._unhealthy.add(addr)

    def mark_healthy(self, addr: str) -> None:
        with self._lock:
            self._unhealthy.discard(addr)

    # --- trajectory end ---
    def finish(self, traj_or_meta: Trajectory | dict) -> None:
        """Forget the trajectory's placement; a full trajectory (object or canonical dict) also feeds
        the policy (tree insert / predictor history)."""
        traj = traj_or_meta if isinstance(traj_or_meta, Trajectory) else None
        if traj is None and isinstance(traj_or_meta, dict) and "segments" in traj_or_meta:
            try:
                traj = parse_canonical(traj_or_meta, "dispatcher.finish")
            except TraceError:
                traj = None
        tid = traj.trajectory_id if traj is not None else str(traj_or_meta.get("trajectory_id"))
        with self._lock:
            self._traj.pop(tid, None)
            self.counters["finished"] += 1
            if traj is not None:
                self.policy.finish(traj)

    def end_step(self) -> None:
        with self._lock:
            self._set_bucket_gpus()
            end = getattr(self.policy, "end_step", None)
            if end is not None:
                end()

    def metrics(self) -> dict:
        with self._lock:
            out = dict(self.counters)
            out["active_trajectories"] = len(self._traj)
            if hasattr(self.policy, "fallback_active"):  # C-MLFQ: decisions routed, and by its fallback
                out["cmlfq_decisions"] = self.policy.routed_decisions
                out["fallback_decisions"] = self.policy.fallback_decisions
                out["fallback_active"] = int(self.policy.fallback_active)
            out["unhealthy"] = len(self._unhealthy)
            for g in self.groups:
                out[f"inflight/{g.name}"] = sum(self._inflight[a] for a in g.addresses)
                out[f"trajectories/{g.name}"] = sum(1 for s in self._traj.values() if self.groups[s.group] is g)
            return out
