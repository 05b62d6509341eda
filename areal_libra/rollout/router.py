"""The request router AReaL calls: every `agenerate` asks it for a server (patch 02), reports back when the
request is done, and asks it for another server when a server fails mid-request (patch 10).

    router = build_router(libra, run_dir)          # from the run's config and rollout_groups.json
    trainer.rollout.set_request_router(router)     # areal_libra/live/train.py does this

Placement is the C-MLFQ `Dispatcher` (areal_libra/cmlfq): a trajectory keeps its group until the
policy moves it at a tool return. The router adds what the live system needs around it: load accounting,
failover with the tokens so far, server health (probe thread, re-admission), the live prefix tree, and
per-step metrics (migrations, per-group load and tokens/s, online routing accuracy, health events).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
import urllib.request
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from areal_libra.cmlfq import Bucket, Dispatcher, NoHealthyServer, ServerGroup, aging, make_policy
from areal_libra.cmlfq.spill import SpillConfig
from areal_libra.config import DispatchConfig, lag_bounded
from areal_libra.rollout.groups import RolloutGroup, expand_servers, group_from_mapping, resolve_groups
from areal_libra.rollout.health import HealthMonitor, probe
from areal_libra.rollout.live_tree import LiveTree
from areal_libra.trace import Trajectory
from areal_libra.utils import append_jsonl, atomic_write_text

log = logging.getLogger(__name__)

GROUPS_FILE = "rollout_groups.json"


class ServerDown(ConnectionError):
    """The server of an in-flight request was marked down; the request moves to another server."""


@dataclass
class _Track:
    decisions: list[list[int]]  # [bucket, model tokens generated under that decision]
    n_tools: int
    group: int
    addr: str
    anonymous: bool = False
    placements: list[tuple[int, str]] = field(default_factory=list)  # (tool returns seen, server) per send
    start_version: int | None = None  # the engine's weight version at the trajectory's first request
    context: int = 0  # its context so far: the last request's input plus what that request generated


@dataclass
class _StepCounters:
    migrations: int = 0
    migrated_tokens: int = 0
    failovers: int = 0
    fallback_moves: int = 0
    routed: int = 0
    finished: int = 0
    decisions: int = 0
    correct: int = 0
    tokens: int = 0
    tokens_ok: int = 0
    health_down: int = 0
    health_up: int = 0
    group_tokens: dict[str, int] = field(default_factory=dict)
    group_requests: dict[str, int] = field(default_factory=dict)


class RequestRouter:
    """Implements the router protocol of patches 02 and 10: route, done, watch, failover, down_addresses."""

    def __init__(
        self,
        groups: Sequence[RolloutGroup],
        addresses: Sequence[Sequence[str]],
        config: DispatchConfig | None = None,
        run_dir: str | Path | None = None,
        restore: bool = False,
        health: bool = True,
        oldest_first: bool = False,
    ) -> None:
        cfg = config or DispatchConfig()
        self.config = cfg
        # Libra's bounded lag (LibraConfig.bound_lag): every request carries its trajectory's start version as
        # its scheduling priority (cmlfq.aging.priority; patch 15 puts it in the payload), so a server serves
        # the oldest trajectories' waiting requests first, as the simulator's servers do (RunConfig.edf).
        self.oldest_first = oldest_first
        self.groups, self.group_addrs = self._ordered(groups, addresses)
        self.group_of = {a: gi for gi, addrs in enumerate(self.group_addrs) for a in addrs}
        self.all_addresses = [a for addrs in self.group_addrs for a in addrs]
        self.dispatcher = self._make_dispatcher(self.groups, self.group_addrs, None)
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.live = LiveTree(
            self.dispatcher, self.run_dir, cfg.rebuild_every_steps, cfg.rebuild_window, online=cfg.online_siblings
        )
        self.restored = bool(restore and self.run_dir is not None and self.live.restore(self.run_dir))
        self._lock = threading.Lock()
        self._watches: dict = {}  # event loop -> [in-flight by server, cancelled by the watchdog, its task]
        # Held while a request is placed and while the layout is switched (reconfiguration), so a request
        # never sees half of an old and half of a new layout.
        self._layout_lock = threading.RLock()
        self._addr_inflight: dict[str, int] = {}  # requests in flight per server (drain waits on it)
        self._retired: dict[str, str] = {}  # server -> group name, out of the layout but maybe draining
        self._evicted: set[str] = set()  # retired servers whose in-flight requests must move now
        self._tracks: dict[str, _Track] = {}
        self.addr_requests: dict[str, int] = dict.fromkeys(self.all_addresses, 0)  # sends per server
        # Where each finished trajectory's requests ran: {trajectory_id: [(tool returns seen, server), ...]}
        self.placement_log: OrderedDict[str, list[tuple[int, str]]] = OrderedDict()
        self._step = _StepCounters()
        self._totals = _StepCounters()
        self._fb_seen = (0, 0)  # C-MLFQ decisions and fallback decisions at the last step_metrics
        self._t_step = time.monotonic()
        self._inflight = [0] * len(self.groups)
        self._area = [0.0] * len(self.groups)
        self._t_load = [self._t_step] * len(self.groups)
        self._engine = None
        self._version_down: dict[str, int] = {}
        self._stale_warned: set[str] = set()
        self._missed_update: set[str] = set()
        self._warned_addresses = False
        self._removed: set[str] = set()  # single servers taken out of routing (remove_server: hybrids)
        self._added: dict[str, str | None] = {}  # single servers routed to (add_server: hybrids) -> group
        self.health = HealthMonitor(
            self.all_addresses,
            self._on_health,
            cfg.health_interval_s,
            cfg.health_timeout_s,
            cfg.fail_after,
            cfg.ok_after,
            self._may_readmit,
        )
        if health:
            self.health.start()

    @staticmethod
    def _ordered(
        groups: Sequence[RolloutGroup], addresses: Sequence[Sequence[str]]
    ) -> tuple[list[RolloutGroup], list[list[str]]]:
        if len(groups) != len(addresses):
            raise ValueError(f"{len(groups)} groups but {len(addresses)} address lists")
        order = sorted(range(len(groups)), key=lambda i: groups[i].max_len)
        gs = [groups[i] for i in order]
        addrs = [list(addresses[i]) for i in order]
        for g, a in zip(gs, addrs):
            if not a:
                raise ValueError(f"rollout group {g.name} has no server address")
        return gs, addrs

    def _make_dispatcher(self, groups: list[RolloutGroup], addrs: list[list[str]], tree) -> Dispatcher:
        cfg = self.config
        switches = {}
        if cfg.policy == "cmlfq":
            # A copy (the policy writes to its config); the live tree rebuilds off the request path instead.
            switches = {"config": replace(cfg.cmlfq, rebuild_every=0)}
            if tree is not None:
                switches["tree"] = tree  # a new layout keeps what the tree has learned
        policy = make_policy(cfg.policy, [Bucket(g.max_len, g.tp) for g in groups], **switches)
        pricing = getattr(self, "_pricing", None)
        if pricing is not None and hasattr(policy, "set_pricer"):
            from areal_libra.cmlfq import MigrationPricer

            hw, model = pricing
            policy.set_pricer(MigrationPricer(hw, model, [g.tp for g in groups], groups[0].max_running))
        return Dispatcher(
            policy,
            [ServerGroup(g.name, g.tp, g.max_len, list(a)) for g, a in zip(groups, addrs)],
            sticky=cfg.sticky,
            spill=None if cfg.spill_ratio is None else SpillConfig(ratio=float(cfg.spill_ratio)),
        )

    def set_pricing(self, hardware, model) -> None:
        """C-MLFQ prices its moves with the Cost Evaluator on this spec (cost.presets HardwareSpec and
        ModelSpec: the planner's, areal_libra.live.train) from now on, in this layout and the next ones."""
        from areal_libra.cmlfq import MigrationPricer

        with self._layout_lock, self.dispatcher.lock:
            self._pricing = (hardware, model)
            pol = self.dispatcher.policy
            if hasattr(pol, "set_pricer"):
                pol.set_pricer(MigrationPricer(hardware, model, [g.tp for g in self.groups],
                                               self.groups[0].max_running))

    # --- live reconfiguration (areal_libra.rollout.fleet) ---
    def set_layout(self, groups: Sequence[RolloutGroup], addresses: Sequence[Sequence[str]]) -> list[str]:
        """Switch to new rollout groups: every request placed from now on (new trajectories, next turns,
        failovers) goes to the new layout. Servers left out get no new request; their in-flight requests
        finish there (or move, see evict). Returns the servers left out."""
        groups, addrs = self._ordered(groups, addresses)
        # Servers added one by one (elastic hybrids serving rollout) are not the fleet's: they stay routed.
        for a, gname in list(self._added.items()):
            gi = next((i for i, g in enumerate(groups) if g.name == gname), len(groups) - 1)
            if all(a not in x for x in addrs):
                addrs[gi] = [*addrs[gi], a]
        self.live.wait(timeout=30)  # a rebuild in progress swaps its tree into the policy it started on
        old_policy = self.dispatcher.policy
        tree = getattr(old_policy, "tree", None) if self.config.policy == "cmlfq" else None
        disp = self._make_dispatcher(groups, addrs, tree)
        if hasattr(disp.policy, "inherit_routing") and hasattr(old_policy, "inherit_routing"):
            disp.policy.inherit_routing(old_policy)  # measured accuracy, fallback verdict, decision counts
        if tree is None and self.config.policy not in ("cmlfq", "round_robin", "least_loaded"):
            log.warning("router: the %s policy starts with no history in the new layout", self.config.policy)
        new_all = [a for x in addrs for a in x]
        with self._layout_lock, self.dispatcher.lock, self._lock:
            for a in self.health.down():
                disp.mark_unhealthy(a)
            for a, n in self._addr_inflight.items():
                for _ in range(n if a in new_all else 0):
                    disp.begin(a)
            old_names = [g.name for g in self.groups]
            left = [a for a in self.all_addresses if a not in new_all]
            for a in left:
                self._retired[a] = old_names[self.group_of[a]]
            for a in new_all:
                self._retired.pop(a, None)
                self._evicted.discard(a)
                self._removed.discard(a)  # a new server may reuse the address of one removed earlier
            index = {g.name: gi for gi, g in enumerate(groups)}
            for tr in self._tracks.values():
                tr.group = index.get(old_names[tr.group], -1) if 0 <= tr.group < len(old_names) else -1
            now = time.monotonic()
            self.groups, self.group_addrs = groups, addrs
            self.group_of = {a: gi for gi, x in enumerate(addrs) for a in x}
            self.all_addresses = new_all
            self._inflight = [sum(self._addr_inflight.get(a, 0) for a in x) for x in addrs]
            self._area = [0.0] * len(groups)
            self._t_load = [now] * len(groups)
            for a in new_all:
                self.addr_requests.setdefault(a, 0)
            self.dispatcher = disp
            self.live.dispatcher, self.live.policy = disp, disp.policy
        self.health.set_addresses(new_all + list(self._retired))
        log.info("router: new layout %s", {g.name: x for g, x in zip(groups, addrs)})
        return left

    def inflight(self, addr: str) -> int:
        """Requests in flight on a server (routed, not yet done or moved)."""
        with self._lock:
            return self._addr_inflight.get(addr, 0)

    def evict(self, addrs: Sequence[str]) -> None:
        """Move the in-flight requests of retired servers now: each is aborted there and resumes on a server
        of the current layout with its tokens so far (the failover path)."""
        with self._lock:
            self._evicted.update(a for a in addrs if a in self._retired)

    def forget(self, addrs: Sequence[str]) -> None:
        """Retired servers that were shut down: no more probing or bookkeeping."""
        with self._lock:
            for a in addrs:
                if a in self.group_of:
                    raise ValueError(f"server {a} is still in the layout")
                self._retired.pop(a, None)
                self._evicted.discard(a)
                self._addr_inflight.pop(a, None)
        self.health.set_addresses(self.all_addresses + list(self._retired))

    def _gone(self, addr: str) -> bool:
        # A removed hybrid server's requests come back aborted (drain) and are re-sent: elsewhere.
        return self.health.is_down(addr) or addr in self._evicted or addr in self._removed

    # --- wiring ---
    def attach_engine(self, engine) -> None:
        """The rollout engine (for its weight version: a server that missed an update stays out)."""
        self._engine = engine

    def _version(self) -> int | None:
        try:
            return None if self._engine is None else int(self._engine.get_version())
        except Exception:  # noqa: BLE001 - no version means no staleness check
            return None

    def _may_readmit(self, addr: str) -> bool:
        if addr in self._missed_update:
            return False
        down_at = self._version_down.get(addr)
        now = self._version()
        if down_at is not None and now is not None and now != down_at:
            # It missed a weight update while it was out: its tokens would be off-policy. It stays out
            # until restarted with current weights (a new run or recover).
            if addr not in self._stale_warned:
                self._stale_warned.add(addr)
                log.warning("rollout server %s answers again but missed weight version %s; kept out", addr, now)
            return False
        return True

    def _on_health(self, addr: str, up: bool, reason: str) -> None:
        with self._lock:
            if up:
                self._step.health_up += 1
                self._totals.health_up += 1
                self._version_down.pop(addr, None)
            else:
                self._step.health_down += 1
                self._totals.health_down += 1
                v = self._version()
                if v is not None:
                    self._version_down[addr] = v
        (self.dispatcher.mark_healthy if up else self.dispatcher.mark_unhealthy)(addr)
        log.warning("rollout server %s %s (%s)", addr, "re-admitted" if up else "marked down", reason)
        if self.run_dir is not None:
            try:
                append_jsonl(
                    self.run_dir / "dispatch_health.jsonl",
                    {"t": round(time.time(), 3), "addr": addr, "up": up, "reason": reason},
                )
            except OSError:
                pass

    def server_failed(self, addr: str, exc: BaseException) -> bool:
        """A control request (pause, continue) failed on addr (patch 10): True if the server is gone, now
        marked down; False if it still answers /health (a real error the caller raises)."""
        if addr in self.health.down() or not probe(addr, self.config.health_timeout_s):
            self.health.report_failure(addr, f"control request failed: {type(exc).__name__}")
            return True
        return False

    def weights_failed(self, addrs: Sequence[str]) -> None:
        """These servers did not take the latest weights (patch 10): out for good, their tokens would be
        off-policy."""
        for a in addrs:
            with self._lock:
                self._missed_update.add(a)
            self.health.report_failure(a, "weight update failed")

    def add_server(self, addr: str, group: str | None = None) -> str:
        """Route to a new server from now on (a hybrid replica serving rollout); `group` by name, None: the
        group with the largest threshold. Returns the group's name."""
        gi = len(self.groups) - 1 if not group else next(
            (i for i, g in enumerate(self.groups) if g.name == group), None)
        if gi is None:
            raise ValueError(f"no rollout group named {group!r} (groups: {[g.name for g in self.groups]})")
        with self._lock:
            self._removed.discard(addr)
            self._added[addr] = group
            self._missed_update.discard(addr)
            self._version_down.pop(addr, None)
        self.dispatcher.add_server(addr, gi)
        with self._lock:
            self.group_addrs[gi].append(addr)
            self.group_of[addr] = gi
            self.all_addresses.append(addr)
            self.addr_requests.setdefault(addr, 0)
        self.health.add(addr)
        return self.groups[gi].name

    def remove_server(self, addr: str) -> bool:
        """Stop routing to addr (it is leaving: drained, then stopped). Requests in flight there finish or
        come back aborted, and are re-sent elsewhere with their tokens so far (`watch`)."""
        with self._lock:
            self._removed.add(addr)
            self._added.pop(addr, None)
        if not self.dispatcher.remove_server(addr):
            return False
        with self._lock:
            gi = self.group_of.get(addr)
            if gi is not None and addr in self.group_addrs[gi]:
                self.group_addrs[gi].remove(addr)
            if addr in self.all_addresses:
                self.all_addresses.remove(addr)
        self.health.remove(addr)
        return True

    def down_addresses(self) -> set[str]:
        """Servers that are out (patch 10 skips them for pause/continue/disk weight updates)."""
        return self.health.down()

    # --- load accounting: the dispatcher's counts plus a time-weighted mean per group for the metrics ---
    def _load_change(self, addr: str, delta: int) -> None:
        now = time.monotonic()
        with self._lock:
            gi = self.group_of.get(addr)
            if gi is None:
                return
            self._area[gi] += self._inflight[gi] * (now - self._t_load[gi])
            self._t_load[gi] = now
            self._inflight[gi] = max(0, self._inflight[gi] + delta)

    def _begin(self, addr: str) -> None:
        self.dispatcher.begin(addr)
        with self._lock:
            self._addr_inflight[addr] = self._addr_inflight.get(addr, 0) + 1
        self._load_change(addr, +1)

    def _end(self, addr: str) -> None:
        self.dispatcher.end(addr)
        with self._lock:
            self._addr_inflight[addr] = max(0, self._addr_inflight.get(addr, 0) - 1)
        self._load_change(addr, -1)

    # --- routing ---
    @staticmethod
    def _meta(req) -> tuple[dict, bool]:
        meta = getattr(req, "metadata", None) or {}
        if "trajectory_id" in meta:
            return meta, False
        # A request that no trajectory-aware workflow sent (e.g. evaluation): route it as a one-turn
        # trajectory so it still goes through placement and load accounting.
        return {"trajectory_id": f"rid:{req.rid}", "prompt_tokens": len(req.input_ids)}, True

    def route(self, req, addresses: Sequence[str] | None = None) -> str:
        meta, anonymous = self._meta(req)
        if addresses is not None and not self._warned_addresses and not set(self.all_addresses) <= set(addresses):
            self._warned_addresses = True  # single-controller workers know only their own server
            log.info(
                "router: engine addresses %s differ from the rollout groups; routing over all groups", list(addresses)
            )
        tid = str(meta["trajectory_id"])
        n_tools = len(meta.get("tool_returns") or ())
        deadline = time.monotonic() + self.config.failover_wait_s
        while True:
            # No healthy server anywhere (e.g. the only one died and a replacement is starting): wait for
            # one, as a failed-over request does, instead of failing the trajectory. The wait is outside the
            # layout lock, which the replacement's layout switch takes.
            try:
                with self._layout_lock:
                    addr = self.dispatcher.route(meta)
                    self._begin(addr)
                    placed = self.dispatcher.placement(tid)
                    bucket = placed[0] if placed else self.group_of[addr]
                    gi = self.group_of[addr]
                    ctx = int(meta.get("context_tokens", len(req.input_ids)))
                    with self._lock:
                        self.addr_requests[addr] = self.addr_requests.get(addr, 0) + 1
                        tr = self._tracks.get(tid)
                        if tr is None:
                            tr = self._tracks[tid] = _Track([[bucket, 0]], n_tools, gi, addr, anonymous,
                                                            start_version=self._version())
                        else:
                            if n_tools > tr.n_tools:
                                tr.decisions.append([bucket, 0])
                                tr.n_tools = n_tools
                                if 0 <= tr.group != gi:  # -1: its group left the layout (no migration)
                                    for c in (self._step, self._totals):
                                        c.migrations += 1
                                        c.migrated_tokens += ctx
                            elif 0 <= tr.group != gi:
                                for c in (self._step, self._totals):
                                    c.fallback_moves += 1
                            tr.group, tr.addr = gi, addr
                        tr.placements.append((n_tools, addr))
                        tr.context = ctx
                        for c in (self._step, self._totals):
                            c.routed += 1
                        start = tr.start_version
                if self.oldest_first and start is not None and isinstance(getattr(req, "metadata", None), dict):
                    req.metadata["priority"] = aging.priority(start)
                return addr
            except NoHealthyServer:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.2)

    def done(self, req, addr: str, output_tokens: Sequence[int], stop_reason: str | None) -> None:
        self._end(addr)
        meta, anonymous = self._meta(req)
        tid = str(meta["trajectory_id"])
        n = len(output_tokens)
        with self._layout_lock:
            name = self.groups[self.group_of[addr]].name if addr in self.group_of else self._retired.get(addr, "?")
        with self._lock:
            for c in (self._step, self._totals):
                c.group_tokens[name] = c.group_tokens.get(name, 0) + n
                c.group_requests[name] = c.group_requests.get(name, 0) + 1
            tr = self._tracks.get(tid)
            if tr is not None:
                tr.decisions[-1][1] += n
                tr.context += n
            if anonymous:
                self._tracks.pop(tid, None)
        if anonymous:
            self.dispatcher.finish({"trajectory_id": tid})

    async def watch(self, req, addr: str, send):
        """Await the request, giving up when its server is marked down (a hung server never answers). One
        watchdog per event loop checks the servers of all in-flight requests every watch_interval_s and cancels
        those on a server that is gone (a timed wait per request and interval was a quarter of the rollout
        thread's CPU with thousands of requests in flight)."""
        if self._gone(addr):
            send.close()
            raise ServerDown(addr)
        task = asyncio.ensure_future(send)
        watched, downed = self._watch_state()
        on_addr = watched.setdefault(addr, {})
        on_addr[task] = getattr(req, "rid", None)
        try:
            return await task
        except asyncio.CancelledError:
            if downed.pop(task, False):  # the watchdog gave up on the server, not a cancel from above
                raise ServerDown(addr) from None
            task.cancel()
            raise
        finally:
            on_addr.pop(task, None)
            downed.pop(task, None)
            if not on_addr and watched.get(addr) is on_addr:
                del watched[addr]

    def _watch_state(self) -> tuple[dict, dict]:
        """This event loop's in-flight requests by server ({addr: {task: rid}}) and the tasks its watchdog
        cancelled, the watchdog started when it is not running."""
        loop = asyncio.get_running_loop()
        st = self._watches.get(loop)
        if st is None:
            st = self._watches[loop] = [{}, {}, None]
        if st[2] is None or st[2].done():
            st[2] = loop.create_task(self._watchdog(st))
        return st[0], st[1]

    async def _watchdog(self, st: list) -> None:
        watched, downed = st[0], st[1]
        loop = asyncio.get_running_loop()
        try:
            while watched:
                await asyncio.sleep(self.config.watch_interval_s)
                for addr in [a for a in watched if self._gone(a)]:
                    for task, rid in list(watched.get(addr, {}).items()):
                        if not task.done():
                            downed[task] = True
                            task.cancel()
                            self._abort_on(addr, rid)
        finally:  # nothing in flight (or the loop closes): the next watch starts a fresh one
            if self._watches.get(loop) is st:
                del self._watches[loop]

    def _abort_on(self, addr: str, rid: str | None) -> None:
        """Best effort: stop the abandoned request on a server that may still be alive but slow."""
        if not rid:
            return

        def _send() -> None:
            try:
                body = json.dumps({"rid": rid}).encode()
                r = urllib.request.Request(
                    f"http://{addr}/abort_request", data=body, headers={"Content-Type": "application/json"}
                )
                urllib.request.urlopen(r, timeout=2).close()
            except Exception:  # noqa: BLE001 - the server is probably gone
                pass

        threading.Thread(target=_send, daemon=True).start()

    async def failover(self, req, addr: str, exc: BaseException) -> str:
        """The request failed on addr: if the server is really gone, mark it down and return another
        server of the same (else the next) group; the request resumes there with the tokens so far
        (AReaL re-sends input + output accumulated so far). A live server means the error is not a
        server failure: it is raised again unchanged."""
        meta, _ = self._meta(req)
        tid = str(meta["trajectory_id"])
        with self._lock:
            tr = self._tracks.get(tid)
            n = getattr(req, "_libra_failovers", 0) + 1
        if not isinstance(exc, ServerDown):
            alive = await asyncio.get_running_loop().run_in_executor(None, probe, addr, self.config.health_timeout_s)
            if alive:
                self._end(addr)
                raise exc
            self.health.report_failure(addr, f"request failed: {type(exc).__name__}")
        self._end(addr)
        if n > self.config.max_failovers:
            raise RuntimeError(f"request {getattr(req, 'rid', '?')} failed over {n - 1} times") from exc
        try:
            req._libra_failovers = n
        except AttributeError:
            pass
        deadline = time.monotonic() + self.config.failover_wait_s
        while True:
            try:
                with self._layout_lock:
                    new = self.dispatcher.route(meta)
                    self._begin(new)
                    gnew = self.group_of[new]
                break
            except NoHealthyServer:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
        with self._lock:
            for c in (self._step, self._totals):
                c.failovers += 1
            self.addr_requests[new] = self.addr_requests.get(new, 0) + 1
            if tr is not None:
                tr.group, tr.addr = gnew, new
                tr.placements.append((tr.n_tools, new))
        log.warning("request %s moved from %s to %s after %s", getattr(req, "rid", "?"), addr, new, type(exc).__name__)
        return new

    def working_tokens(self, max_lag: int | None = None) -> int:
        """The running trajectories' contexts (prompt, generated tokens and tool payloads so far, whether
        decoding, queued or waiting on a tool): the working set of Libra's admission (cmlfq.aging.admit_group).
        With `max_lag`, trajectories that started more than max_lag weight versions ago are left out: under the
        lag bound the trainer has taken them by then, so one still listed ended without reaching the sink (its
        workflow failed) and holds no KV."""
        now = self._version() if max_lag is not None else None
        with self._lock:
            return sum(tr.context for tr in self._tracks.values()
                       if now is None or tr.start_version is None or now - tr.start_version <= max_lag)

    # --- trajectory end ---
    def on_trajectory(self, traj: Trajectory) -> None:
        """The workflow's trajectory sink: score the online routing decisions, then feed the live tree."""
        with self._lock:
            tr = self._tracks.pop(traj.trajectory_id, None)
            if tr is not None:
                self.placement_log[traj.trajectory_id] = tr.placements
                while len(self.placement_log) > 4096:
                    self.placement_log.popitem(last=False)
                oracle = self.dispatcher.policy.bucket_of(traj.final_length)
                for c in (self._step, self._totals):
                    c.finished += 1
                    for b, toks in tr.decisions:
                        c.decisions += 1
                        c.correct += b == oracle
                        c.tokens += toks
                        c.tokens_ok += toks if b == oracle else 0
        self.live.add(traj)

    # --- metrics ---
    def learn_finished(self) -> None:
        """Let the trajectories finished since the last step boundary reach the routing policy now (the
        profiling pass before step 1: the simulator's C-MLFQ starts fitted on its profile)."""
        self.live.end_step()

    def step_metrics(self) -> dict:
        """Flat per-step metrics (metrics.jsonl); also the training-step boundary of the live tree."""
        self.live.end_step()
        now = time.monotonic()
        with self._lock:
            s, self._step = self._step, _StepCounters()
            dt = max(now - self._t_step, 1e-9)
            self._t_step = now
            mean_load = []
            for gi in range(len(self.groups)):
                self._area[gi] += self._inflight[gi] * (now - self._t_load[gi])
                self._t_load[gi] = now
                mean_load.append(self._area[gi] / dt)
                self._area[gi] = 0.0
        d = self.dispatcher.metrics()
        # Share of this step's C-MLFQ decisions its least-loaded fallback made (None: none routed).
        fb_frac = None
        if "cmlfq_decisions" in d:
            last_r, last_f = self._fb_seen
            dr, df = d["cmlfq_decisions"] - last_r, d["fallback_decisions"] - last_f
            if dr < 0:  # a policy that did not inherit the counts
                dr, df = d["cmlfq_decisions"], d["fallback_decisions"]
            self._fb_seen = (d["cmlfq_decisions"], d["fallback_decisions"])
            fb_frac = df / dr if dr > 0 else None
        out = {
            "cmlfq/migrations": s.migrations,
            "cmlfq/migrated_tokens": s.migrated_tokens,
            "cmlfq/migrations_total": self._totals.migrations,
            "cmlfq/failovers": s.failovers,
            "cmlfq/fallback_moves": s.fallback_moves,
            "cmlfq/routed": s.routed,
            "cmlfq/finished": s.finished,
            "cmlfq/decision_accuracy": s.correct / s.decisions if s.decisions else None,
            "cmlfq/fallback_fraction": fb_frac,
            "cmlfq/fallback_active": d.get("fallback_active"),
            "cmlfq/token_accuracy": s.tokens_ok / s.tokens if s.tokens else None,
            "cmlfq/health_down": s.health_down,
            "cmlfq/health_up": s.health_up,
            "cmlfq/unhealthy_servers": d.get("unhealthy", 0),
        }
        for gi, g in enumerate(self.groups):
            out[f"cmlfq/inflight/{g.name}"] = d.get(f"inflight/{g.name}", 0)
            out[f"cmlfq/inflight_mean/{g.name}"] = round(mean_load[gi], 3)
            out[f"cmlfq/tokens_per_s/{g.name}"] = round(s.group_tokens.get(g.name, 0) / dt, 3)
            out[f"cmlfq/requests/{g.name}"] = s.group_requests.get(g.name, 0)
        out.update(self.live.metrics())
        if self.config.wandb:
            publish_metrics(out)
        return out

    def totals(self) -> dict:
        with self._lock:
            t = self._totals
            return {
                "migrations": t.migrations,
                "migrated_tokens": t.migrated_tokens,
                "failovers": t.failovers,
                "routed": t.routed,
                "finished": t.finished,
                "decisions": t.decisions,
                "correct": t.correct,
                "health_down": t.health_down,
                "health_up": t.health_up,
                "group_requests": dict(t.group_requests),
                "group_tokens": dict(t.group_tokens),
            }

    def close(self) -> None:
        self.health.stop()
        self.live.wait(timeout=30)


def publish_metrics(metrics: dict) -> None:
    """Merge into the W&B step AReaL has just logged (the metrics sources run right after its wandb.log)."""
    try:
        import wandb
    except ImportError:
        return
    run = wandb.run
    if run is None:
        return
    try:
        run.log({k: v for k, v in metrics.items() if v is not None}, step=run.step)
    except Exception as e:  # noqa: BLE001 - metrics must never stop training
        log.warning("router metrics not logged to W&B: %s", e)


# --- construction from a run ---------------------------------------------------------------------------


def groups_body(groups: Sequence[RolloutGroup], addresses: Sequence[Sequence[str]]) -> list[dict]:
    """The groups as rollout_groups.json stores them (and RemoteRouter ships them): one dict per group."""
    return [{"name": g.name, "tp": g.tp, "count": g.count, "threads": g.threads, "max_running": g.max_running,
             "max_len": g.max_len, "addresses": list(a)} for g, a in zip(groups, addresses)]


def write_groups_file(run_dir: str | Path, groups: Sequence[RolloutGroup], addresses: Sequence[str]) -> Path:
    """Record which server address belongs to which group (launch order = address order)."""
    servers = expand_servers(groups)
    if len(servers) != len(addresses):
        raise ValueError(f"{len(servers)} servers in the rollout groups but {len(addresses)} addresses")
    it = iter(addresses)
    body = groups_body(groups, [[next(it) for _ in range(g.count)] for g in groups])
    p = Path(run_dir) / GROUPS_FILE
    atomic_write_text(p, json.dumps({"groups": body}, indent=1) + "\n")
    return p


def read_groups_file(path: str | Path) -> tuple[list[RolloutGroup], list[list[str]]]:
    try:
        d = json.loads(Path(path).read_text())
        groups = [
            group_from_mapping({k: v for k, v in g.items() if k != "addresses"}, i) for i, g in enumerate(d["groups"])
        ]
        addrs = [list(g["addresses"]) for g in d["groups"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: cannot read rollout groups ({type(e).__name__}: {e})") from None
    return groups, addrs


def _recover_enabled(run_dir: Path) -> bool:
    p = run_dir / "areal_config.yaml"
    if not p.exists():
        return False
    from omegaconf import OmegaConf

    mode = str(OmegaConf.select(OmegaConf.load(p), "recover.mode", default="disabled"))
    return mode not in ("disabled", "None", "")


def build_router(
    libra: Mapping,
    run_dir: str | Path,
    addresses: Sequence[str] | None = None,
    max_tokens: int | None = None,
    health: bool = True,
) -> RequestRouter:
    """The run's router: groups and addresses from <run_dir>/rollout_groups.json (written by launch), or
    from the config's groups split over `addresses` / AREAL_LLM_SERVER_ADDRS in launch order."""
    run_dir = Path(run_dir)
    from areal_libra.config import libra_config

    libra = libra_config(libra)  # typed (a dict or DictConfig: checked here, one line per bad key)
    cfg = libra.scheduler
    gfile = run_dir / GROUPS_FILE
    if gfile.exists() and addresses is None:
        groups, addrs = read_groups_file(gfile)
        if not all(g.max_len for g in groups):
            raise ValueError(f"{gfile}: every group needs its max_len threshold")
    else:
        if max_tokens is None:
            raise ValueError("build_router: max_tokens is needed when there is no rollout_groups.json")
        groups = resolve_groups(libra, max_tokens)
        flat = (
            list(addresses)
            if addresses is not None
            else [a for a in os.environ.get("AREAL_LLM_SERVER_ADDRS", "").split(",") if a]
        )
        servers = expand_servers(groups)
        if len(flat) != len(servers):
            raise ValueError(f"rollout groups have {len(servers)} servers but {len(flat)} addresses were given")
        it = iter(flat)
        addrs = [[next(it) for _ in range(g.count)] for g in groups]
    rank = int(os.environ.get("RANK", "0") or 0)
    # SPMD with several trainer ranks: every rank routes its own share of the rollouts; rank 0 keeps the run
    # directory's tree files, the others save theirs in a sub-folder.
    own = run_dir if rank == 0 else run_dir / f"router-rank{rank}"
    own.mkdir(parents=True, exist_ok=True)
    return RequestRouter(groups, addrs, cfg, own, restore=_recover_enabled(run_dir), health=health,
                         oldest_first=lag_bounded(libra))


# --- single-controller mode ----------------------------------------------------------------------------


@dataclass
class RemoteRouter:
    """The router for AReaL's single-controller mode, where workflows run inside rollout workers.

    Choice: every rollout worker gets the full group map and routes its own requests (instead of asking
    the controller per request). A trajectory never leaves the worker that runs its workflow, so its
    placement state is local anyway; a per-request round trip to the controller would add an RPC to every
    turn and make the controller a bottleneck. The price: each worker sees only its own load, and learns
    its tree from its own trajectories (saved per worker under <run_dir>/router-<pid>/).

    It is a dataclass of plain fields so that AReaL's RPC serialization (dataclass by class path) carries
    it to the worker: `controller._collective_rpc("set_request_router", router=RemoteRouter(...))`. The
    live router is built on first use inside the worker.
    """

    groups: list
    scheduler: dict
    run_dir: str = ""
    workflow: str = ""  # module path whose set_trajectory_sink should feed this router

    def _get(self) -> RequestRouter:
        r = self.__dict__.get("_router")
        if r is None:
            gs = [
                group_from_mapping({k: v for k, v in g.items() if k != "addresses"}, i)
                for i, g in enumerate(self.groups)
            ]
            run_dir = Path(self.run_dir) / f"router-{os.getpid()}" if self.run_dir else None
            if run_dir is not None:
                run_dir.mkdir(parents=True, exist_ok=True)
            r = RequestRouter(
                gs, [list(g["addresses"]) for g in self.groups], DispatchConfig.from_mapping(self.scheduler), run_dir
            )
            self.__dict__["_router"] = r
            if self.workflow:
                import importlib

                mod = importlib.import_module(self.workflow.rpartition(".")[0] or self.workflow)
                if hasattr(mod, "set_trajectory_sink"):
                    mod.set_trajectory_sink(r.on_trajectory)
        return r

    def route(self, req, addresses=None) -> str:
        return self._get().route(req, addresses)

    def done(self, req, addr: str, output_tokens, stop_reason) -> None:
        self._get().done(req, addr, output_tokens, stop_reason)

    def watch(self, req, addr: str, send):
        return self._get().watch(req, addr, send)

    async def failover(self, req, addr: str, exc: BaseException) -> str:
        return await self._get().failover(req, addr, exc)

    def add_server(self, addr: str, group: str | None = None) -> str:
        return self._get().add_server(addr, group)

    def remove_server(self, addr: str) -> bool:
        return self._get().remove_server(addr)

    def down_addresses(self) -> set[str]:
        return self._get().down_addresses()

    def server_failed(self, addr: str, exc: BaseException) -> bool:
        return self._get().server_failed(addr, exc)

    def weights_failed(self, addrs) -> None:
        self._get().weights_failed(addrs)

    @classmethod
    def from_groups_file(cls, run_dir: str | Path, libra: Mapping) -> RemoteRouter:
        groups, addrs = read_groups_file(Path(run_dir) / GROUPS_FILE)
        body = groups_body(groups, addrs)
        from dataclasses import asdict

        from areal_libra.config import libra_config

        typed = libra_config(libra)
        return cls(body, asdict(typed.scheduler), str(run_dir), typed.workflow)


def install_single_controller(controller, router: RemoteRouter) -> None:
    """Give every rollout worker of a RolloutController the full group map and its own router."""
    controller._collective_rpc("set_request_router", router=router)
