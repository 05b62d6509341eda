"""Live reconfiguration of the rollout server groups, inside the trainer process.

    fleet = build_fleet(trainer, router, run_dir)            # after install_router (train.py)
    fleet.reconfigure([RolloutGroup("tp1", 1, 2, ...), RolloutGroup("tp2", 2, 1, ...)], step)

A reconfiguration keeps every server whose kind (TP, threads, batch limit) the new layout still needs and
only starts and stops the difference. New servers start with the CURRENT weights (the checkpoint of the
last disk weight update, which the fleet keeps instead of letting AReaL delete it) and must report the
engine's weight version before they get any request. Then the router's groups and the engine's address
list switch together, so every request placed from then on goes to the new layout. Servers left out get
no new request; their in-flight requests finish there, or after `drain_timeout_s` are aborted and resume on
a server of the new layout with their tokens so far (the router's failover path), and they are shut down.
`<run_dir>/rollout_groups.json` and `<run_dir>/servers.json` (pid, address, group of every server) follow
every change; areal_libra/launch.py supervises and cleans up from servers.json.

The fleet is the one owner of rollout membership: the only code that edits the engine's address list, the
router's layout and the engine's weight-update hook. Elastic hybrids (servers the fleet does not start) come
and go through it too: `attach_hybrid(addr)` puts a hybrid's server into the next disk weight update and
routes to it once that update has landed; `detach_hybrid(addr)` takes it out of the router and the
address list. A reconfiguration keeps the attached hybrids.

Weight updates over xccl (actor.weight_update_mode=xccl, the GPU configuration): there is no checkpoint of
the current weights, so new servers start on the base model and are not routed; the next weight update (the
fleet wraps the train engine's update_weights on rank 0) first forms the weight-update group again over the
servers that should get it (rollout/xccl.py: patch 11's rank offsets, in address order), broadcasts to all
of them, and then switches router and engine to the new layout and drains the leaving servers. The same
step leaves dead servers out of the group, so an update never waits for a server that is gone. If the new
servers cannot join, the change is dropped (they are stopped, fleet.jsonl says why) and the update goes to
the old layout. Elastic hybrids need disk weight updates.

A server that cannot start (or dies before the switch) fails the reconfiguration with a FleetError (one
line) and leaves the old layout serving; every failure is also a line in fleet.jsonl (`failed`: the reason); a server that dies after the switch is the router's business
(failover), as in a run without reconfiguration.

Devices (cluster=gpu, or any fleet given a device pool): new servers take free devices of the rollout pool.
On a full node the new layout cannot start beside the old one, so the leaving servers whose devices it needs
are stopped first (break-before-make, the fewest devices: placement.servers_to_retire); their requests move
to the servers that stay or wait for the new ones. If the new layout then fails to start, servers of the
old layout are started again on the freed devices before the FleetError is raised.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import shutil
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from areal_libra.config import lag_bounded, load_run_config
from areal_libra.rollout.backend import LocalProcessBackend, RunningServer, ServerBackend, backend_for_device
from areal_libra.rollout.emulated_host import EmulatedHostBackend
from areal_libra.rollout.futures import then_record
from areal_libra.rollout.groups import GroupConfigError, RolloutGroup, assign_buckets, format_allocation
from areal_libra.rollout.launcher import ServerLaunchError, ServerSpec, libra_sglang_flags
from areal_libra.rollout.placement import (
    ROLLOUT_DEVICES_ENV,
    PlacementError,
    place_new_servers,
    servers_to_retire,
)
from areal_libra.rollout.router import GROUPS_FILE, read_groups_file, write_groups_file
from areal_libra.rollout.xccl import WeightGroup, WeightGroupError
from areal_libra.utils import append_jsonl, atomic_write_text, first_line, pid_alive

log = logging.getLogger(__name__)

REGISTRY_FILE = "servers.json"
FLEET_LOG = "fleet.jsonl"


class FleetError(RuntimeError):
    """A reconfiguration that could not be done; the message is one line, the old layout still serves.
    `transient`: the reason passes by itself (a weight update in progress); trying again later may work."""

    def __init__(self, message: str, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


@dataclass
class FleetServer:
    """One rollout server the fleet knows: started by the trainer through a backend (handle) or by the
    launcher (pid only)."""

    addr: str
    group: str
    tp: int = 1
    threads: int = 1
    max_running: int = 256
    pid: int | None = None
    handle: RunningServer | None = None
    owner: str = "launcher"  # launcher | trainer
    log_path: str = ""
    gpus: tuple[str, ...] = ()  # its devices (sglang), as the launcher sees them
    backend: ServerBackend | None = None  # the one that started it (handle), which stops it

    @property
    def kind(self) -> tuple[int, int, int]:
        """What a server is; one of the same kind can serve any group that asks for it."""
        return (self.tp, self.threads, self.max_running)

    def alive(self) -> bool:
        if self.handle is not None:
            return self.handle.alive()
        return self.pid is not None and pid_alive(self.pid)

    def stop(self, timeout: float = 10.0) -> None:
        if self.handle is not None and self.backend is not None:
            self.backend.stop(self.handle, timeout)
            return
        if self.pid is None:
            return
        # Started by the launcher in its own session: the process group is the server and its children.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while pid_alive(self.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)

    def record(self, state: str) -> dict:  # serving | draining | starting (xccl: joins at the next update)
        return {"addr": self.addr, "group": self.group, "tp": self.tp, "pid": self.pid, "owner": self.owner,
                "state": state, "log": self.log_path, "gpus": list(self.gpus)}


@dataclass(frozen=True)
class _Weights:
    path: str
    version: int | None  # None: whatever the engine's version is when they are used
    owned: bool  # the fleet keeps this checkpoint alive for new servers; it deletes it when superseded


@dataclass(eq=False)
class _Pending:
    """xccl: a reconfiguration whose new servers are up but serve the base weights until the next weight
    update reaches them (the group is formed over them first); then the router switches to `rows`."""

    step: int
    target: list[RolloutGroup]
    rows: list[list[FleetServer]]
    new: list[FleetServer]
    leaving: list[FleetServer]  # still serving until the switch
    t0: float
    retired: list[FleetServer] = field(default_factory=list)  # stopped first to make room (break-before-make)


@dataclass(frozen=True, eq=False)
class _Hybrid:
    group: str | None
    on_ready: Callable[[str, bool], None] | None


def _get_json(addr: str, path: str, timeout: float = 10.0) -> dict:
    with urllib.request.urlopen(f"http://{addr}{path}", timeout=timeout) as r:
        return json.loads(r.read())


def _post_json(addr: str, path: str, body: dict, timeout: float = 600.0) -> dict:
    req = urllib.request.Request(f"http://{addr}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"{}")


class ServerFleet:
    """The rollout servers of a run and their live reconfiguration (rank 0 of the trainer)."""

    def __init__(
        self,
        engine,
        router,
        model_path: str,
        log_dir: str | Path,
        backend: ServerBackend | None = None,  # how new servers start (None: embedded local processes)
        servers: Sequence[FleetServer | RunningServer] = (),  # serving now: handles `backend` stops, or pids
        groups: Sequence[RolloutGroup] = (),
        run_dir: str | Path | None = None,
        start_timeout_s: float = 600.0,
        drain_timeout_s: float = 60.0,
        evict_timeout_s: float = 10.0,  # evicted requests give up within the watch interval
        rollout_devices: Sequence[str] = (),  # the devices new servers may take (placement.py)
        weight_group: WeightGroup | None = None,  # xccl weight updates: the group to re-form (None: disk)
    ) -> None:
        if router is None or not hasattr(router, "set_layout"):
            raise FleetError("live reconfiguration needs the project's request router "
                             "(libra.scheduler.policy other than round_robin)")
        self.engine = engine
        self._inner = getattr(engine, "_engine", engine)  # RemoteInfEngine: addresses, lock, version
        self.router = router
        self.model_path = str(model_path)
        self.log_dir = Path(log_dir)
        self.backend: ServerBackend = backend if backend is not None else LocalProcessBackend("embedded")
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.start_timeout_s = start_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.evict_timeout_s = evict_timeout_s
        self.rollout_devices = tuple(rollout_devices)
        # sglang always places on devices; an embedded fleet only when given a device pool (tests, emulation)
        self.places_devices = self.backend.places_devices or bool(self.rollout_devices)
        self.groups = list(groups) if groups else list(router.groups)
        self.servers: list[FleetServer] = [self._as_server(s) for s in servers]
        by_addr = {s.addr: s for s in self.servers}
        for g, addrs in zip(router.groups, router.group_addrs):
            for a in addrs:
                if a not in by_addr:  # known to the router only: a launcher server without a registry entry
                    s = FleetServer(a, g.name, g.tp, g.threads, g.max_running)
                    self.servers.append(s)
                    by_addr[a] = s
        self._lock = threading.Lock()  # weights record, in-flight weight updates, hybrids
        self._reconf = threading.Lock()  # one reconfiguration at a time
        self._updating = 0
        # Checkpoints a reconfiguration is starting servers from: a weight update that lands meanwhile must
        # not delete them (their deletion waits in _deferred until the reconfiguration ends).
        self._pinned: set[str] = set()
        self._deferred: set[str] = set()
        # The servers serve model_path at the engine's version now (a fresh run: version 0).
        self._weights = _Weights(self.model_path, int(self._inner.get_version()), owned=False)
        # Elastic hybrids by address: attached (waiting for the next weight update), in an update, routed.
        self._hybrid_pending: dict[str, _Hybrid] = {}
        self._hybrid_updating: dict[str, _Hybrid] = {}
        self._hybrids: set[str] = set()
        self._orig_update = None
        self._hook_weight_updates()
        self.reconfigurations = 0
        self.weight_group = weight_group
        self._pending: _Pending | None = None
        self._orig_train_update = None
        if weight_group is not None:
            if weight_group.members is None:  # AReaL formed the first group over the launch servers
                size = {s.addr: s.tp for s in self.servers}
                weight_group.members = tuple((a, size.get(a, 1)) for a in self._inner.addresses)
            self._hook_xccl_updates()
        self._write_files()

    @property
    def xccl(self) -> bool:
        """Weight updates broadcast over the xccl group (new servers join it at the next update)."""
        return self.weight_group is not None

    @property
    def pending(self) -> bool:
        """xccl: a reconfiguration waits for the next weight update."""
        return self._pending is not None

    def _as_server(self, s: FleetServer | RunningServer) -> FleetServer:
        if isinstance(s, FleetServer):
            if s.handle is not None and s.backend is None:
                s.backend = self.backend  # a server handed over with its handle: this fleet's backend stops it
            return s
        g = next((g for g in self.groups if g.name == s.spec.group), None)
        return FleetServer(s.addr, s.spec.group, s.spec.tp, s.spec.threads,
                           g.max_running if g is not None else s.spec.max_running, s.pid, s, "trainer",
                           s.log_path, tuple(s.gpu_ids), self.backend)

    # --- current weights -------------------------------------------------------------------------------
    def _hook_weight_updates(self) -> None:
        """Record the checkpoint of every disk weight update, and keep it on disk (AReaL deletes it after
        loading) until the next one lands: a server started later loads it."""
        inner = self._inner
        orig = getattr(inner, "update_weights_from_disk", None)
        if orig is None:
            return
        self._orig_update = orig

        def update_weights_from_disk(meta):
            clear = bool(getattr(meta, "clear_checkpoint_after_load", False))
            kept = copy.copy(meta)
            kept.clear_checkpoint_after_load = False
            with self._lock:
                self._updating += 1
                # Attached hybrids join the address list now: this update reaches them.
                hybrids, self._hybrid_pending = self._hybrid_pending, {}
                for addr in hybrids:
                    if addr not in inner.addresses:
                        inner.addresses.append(addr)
                self._hybrid_updating.update(hybrids)
            try:
                fut = orig(kept)
            except BaseException:
                with self._lock:
                    self._updating -= 1
                raise

            def record(f) -> None:
                if hybrids:
                    self._hybrids_updated(hybrids, f)
                ok = not f.cancelled() and f.exception() is None
                with self._lock:
                    self._updating -= 1
                    prev = self._weights
                    if ok:
                        self._weights = _Weights(str(meta.path), meta.version, owned=clear)
                    stale = prev if ok else _Weights(str(meta.path), None, owned=clear)
                    drop = stale.owned and stale.path != self._weights.path
                    if drop and stale.path in self._pinned:
                        self._deferred.add(stale.path)
                        drop = False
                if drop:
                    shutil.rmtree(stale.path, ignore_errors=True)

            return then_record(fut, record)  # the trainer may reconfigure as soon as it wakes

        inner.update_weights_from_disk = update_weights_from_disk

    def current_weights(self) -> tuple[str, int]:
        """(checkpoint path, version) a new server must serve: the engine's current version."""
        with self._lock:
            w, updating = self._weights, self._updating
        now = int(self._inner.get_version())
        if updating:
            raise FleetError("a weight update is in progress; reconfigure between training steps", transient=True)
        if w.version is not None and w.version != now:
            raise FleetError(
                f"the current weights (version {now}) are not on disk (the last disk weight update was version "
                f"{w.version}); live reconfiguration needs actor.weight_update_mode=disk"
            )
        if not os.path.isdir(w.path):
            raise FleetError(f"the checkpoint of weight version {now} is gone ({w.path})")
        return w.path, now

    # --- elastic hybrids: servers the fleet does not start, routed while their replica is in rollout ----
    def attach_hybrid(self, addr: str, group: str | None = None,
                      on_ready: Callable[[str, bool], None] | None = None) -> None:
        """Bring a hybrid replica's server in. It may serve other weights now, so it is not routed yet: the
        next disk weight update reaches it (it joins the engine's addresses right before), and once that
        update has landed there it is routed to (`group` by name; None: the router's last group) and
        `on_ready(addr, True)` is called; `on_ready(addr, False)` if the update failed there (it stays out).
        Both happen before the update's future resolves (the trainer's wait)."""
        if self.xccl:
            raise FleetError("elastic hybrids join through disk weight updates; this run uses "
                             "actor.weight_update_mode=xccl")
        with self._lock:
            self._hybrid_pending[addr] = _Hybrid(group, on_ready)

    def detach_hybrid(self, addr: str) -> bool:
        """Take a hybrid's server out: no new request from now on (the router re-sends what comes back
        aborted), no further weight update or pause (the engine's addresses). Returns whether it was routed."""
        with self._lock:
            self._hybrid_pending.pop(addr, None)
            self._hybrid_updating.pop(addr, None)
            routed = addr in self._hybrids
            self._hybrids.discard(addr)
        if routed:
            self.router.remove_server(addr)
        if addr in self._inner.addresses:
            self._inner.addresses.remove(addr)
        return routed

    def hybrid_addresses(self) -> set[str]:
        """Every attached hybrid's server, routed or still taking its first weight update."""
        with self._lock:
            return set(self._hybrid_pending) | set(self._hybrid_updating) | self._hybrids

    def hybrids(self) -> list[str]:
        """The attached hybrids' servers that are routed now."""
        with self._lock:
            return sorted(self._hybrids)

    def _hybrids_updated(self, batch: dict[str, _Hybrid], fut) -> None:
        """A weight update that carried attached hybrids has finished: route those it reached."""
        try:
            res = fut.result()
            failed = set(res[1]) if isinstance(res, tuple) else set()
        except Exception as e:  # noqa: BLE001 - the update raised for everyone; the trainer sees it
            log.warning("weight update failed; hybrid servers %s stay out: %s", list(batch), e)
            failed = set(batch)
        done: list[tuple[_Hybrid, str, bool]] = []
        with self._lock:
            for addr, h in batch.items():
                if self._hybrid_updating.get(addr) is not h:
                    continue  # detached while the update ran
                del self._hybrid_updating[addr]
                if addr in failed:
                    if addr in self._inner.addresses:
                        self._inner.addresses.remove(addr)
                else:
                    self.router.add_server(addr, h.group or None)
                    self._hybrids.add(addr)
                done.append((h, addr, addr not in failed))
        for h, addr, ok in done:  # outside the lock: the caller may detach from its callback's thread
            if h.on_ready is not None:
                h.on_ready(addr, ok)

    # --- reconfiguration -------------------------------------------------------------------------------
    def _validate(self, groups: Sequence[RolloutGroup]) -> list[RolloutGroup]:
        if not groups:
            raise FleetError("reconfigure: at least one rollout group is needed")
        for g in groups:
            for what in ("tp", "count", "threads", "max_running"):
                v = getattr(g, what)
                if not isinstance(v, int) or v < 1:
                    raise FleetError(f"reconfigure: group {g.name!r}: {what} must be a positive integer, got {v!r}")
        max_tokens = max([g.max_len for g in self.groups] + [g.max_len for g in groups] + [1])
        try:
            return assign_buckets(list(groups), max_tokens)
        except GroupConfigError as e:
            raise FleetError(f"reconfigure: {e}") from None

    def _plan(self, target: list[RolloutGroup]) -> tuple[list[list[FleetServer | None]], list[FleetServer]]:
        """Per target group its servers (None: to start) and the servers to stop. Kept servers are alive
        and healthy ones of the right kind, preferring those already in a group of the same name."""
        down = self.router.down_addresses()
        pool = [s for s in self.servers if s.alive() and s.addr not in down]
        slots: list[list[FleetServer | None]] = []
        for g in target:
            kind = (g.tp, g.threads, g.max_running)
            mine = sorted((s for s in pool if s.kind == kind), key=lambda s: s.group != g.name)[: g.count]
            for s in mine:
                pool.remove(s)
            slots.append(list(mine) + [None] * (g.count - len(mine)))
        kept = {id(s) for row in slots for s in row if s is not None}
        return slots, [s for s in self.servers if id(s) not in kept]

    def _start(self, target: list[RolloutGroup], slots: list[list[FleetServer | None]], path: str,
               version: int | None) -> list[FleetServer]:
        """Start the empty slots' servers on `path`; they must report `version` (None: xccl, they get the
        current weights at the next update)."""
        specs = [ServerSpec(tp=g.tp, threads=g.threads, max_running=g.max_running, group=g.name)
                 for g, row in zip(target, slots) for s in row if s is None]
        if not specs:
            return []

        placement = None
        if self.places_devices:
            # Free devices of the rollout pool only: never the trainer's, never a live server's (a dead
            # one's are free again). The leaving servers still hold theirs unless _make_room stopped them.
            held = {d for s in self.servers if s.alive() for d in s.gpus}
            try:
                placement = place_new_servers(self.rollout_devices, held, [s.tp for s in specs])
            except PlacementError as e:
                raise FleetError(f"reconfigure: {e}") from None
        try:
            handles = self.backend.start(path, specs, str(self.log_dir),
                                         devices=None if placement is None else placement.servers,
                                         weight_version=version, timeout=self.start_timeout_s)
        except (ServerLaunchError, OSError, ValueError) as e:
            what = ", ".join(f"TP{s.tp} ({s.group})" for s in specs)
            raise FleetError(f"reconfigure: cannot start {what}: {first_line(e)}") from e
        new = [self._as_server(h) for h in handles]
        if version is None:
            return new
        try:
            for s in new:
                self._ensure_version(s, path, version)
        except BaseException:
            for s in new:
                s.stop()
            raise
        return new

    def _ensure_version(self, s: FleetServer, path: str, version: int) -> None:
        """The server must report the engine's weight version before it takes requests."""
        want = str(version)
        try:
            got = str(_get_json(s.addr, "/model_info").get("weight_version"))
            if got != want:
                r = _post_json(s.addr, "/update_weights_from_disk", {"model_path": path, "weight_version": want})
                if not r.get("success", False):
                    raise FleetError(f"reconfigure: server {s.addr} did not load {path}: {r.get('message')}")
                got = str(_get_json(s.addr, "/model_info").get("weight_version"))
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise FleetError(f"reconfigure: new server {s.addr} ({s.group}) stopped answering: {first_line(e)}") from e
        if got != want:
            raise FleetError(f"reconfigure: new server {s.addr} reports weight version {got}, expected {want}")

    def _switch(self, target: list[RolloutGroup], rows: list[list[FleetServer]], new: list[FleetServer],
                path: str, version: int) -> list[str]:
        """Router groups and engine addresses change together, and only while no weight update is under
        way and the weights the new servers loaded are still current."""
        addrs = [[s.addr for s in row] for row in rows]
        flat = [a for row in addrs for a in row]
        deadline = time.monotonic() + 120
        while True:
            with self._lock:
                now = int(self._inner.get_version())
                if self._updating == 0 and now == version:
                    for s in new:
                        if not s.alive():
                            raise FleetError(f"reconfigure: new server {s.addr} ({s.group}) died before it "
                                             "served; the old layout keeps serving")
                    with self._inner.lock:  # AReaL's engine lock (weight version)
                        left = self.router.set_layout(target, addrs)
                        # Attached elastic hybrids stay in the list that weight updates go to (the router
                        # keeps routing to them too).
                        hybrids = self._hybrids | set(self._hybrid_updating)
                        self._inner.addresses = flat + [a for a in self._inner.addresses
                                                        if a in hybrids and a not in flat]
                    return left
                busy = self._updating > 0
            if not busy:  # the weights moved on while the servers started: load the new ones
                path, version = self.current_weights()
                for s in new:
                    self._ensure_version(s, path, version)
                continue
            if time.monotonic() > deadline:
                raise FleetError("reconfigure: a weight update did not finish within 120 s", transient=True)
            time.sleep(0.2)

    def _drain(self, leaving: list[FleetServer]) -> int:
        """Wait for the leaving servers' in-flight requests; move what is left after drain_timeout_s.
        Returns how many requests were moved."""
        def busy() -> list[FleetServer]:
            return [s for s in leaving if self.router.inflight(s.addr) > 0]

        deadline = time.monotonic() + self.drain_timeout_s
        while busy() and time.monotonic() < deadline:
            time.sleep(0.1)
        left = busy()
        moved = sum(self.router.inflight(s.addr) for s in left)
        if left:
            self.router.evict([s.addr for s in left])
            deadline = time.monotonic() + self.evict_timeout_s
            while busy() and time.monotonic() < deadline:
                time.sleep(0.1)
            for s in busy():
                log.warning("fleet: %d requests still on %s after eviction; stopping it anyway",
                            self.router.inflight(s.addr), s.addr)
        return moved

    @contextlib.contextmanager
    def _pinned_checkpoint(self, path: str) -> Iterator[None]:
        """Keep `path` on disk while new servers load it, even if a weight update makes it stale."""
        with self._lock:
            self._pinned.add(path)
        try:
            yield
        finally:
            with self._lock:
                self._pinned.discard(path)
                drop = path in self._deferred and path != self._weights.path
                self._deferred.discard(path)
            if drop:
                shutil.rmtree(path, ignore_errors=True)

    def _make_room(self, target: list[RolloutGroup], slots: list[list[FleetServer | None]],
                   leaving: list[FleetServer]) -> tuple[list[FleetServer], int]:
        """Break-before-make on a full node: when the new servers do not fit beside every live one, stop the
        leaving servers whose devices they need first (the fewest devices: placement.servers_to_retire).
        Their requests move now, with their tokens so far, to the servers that stay, or wait in the router
        (up to scheduler.failover_wait_s) for the new ones. Returns (the servers stopped, requests moved)."""
        tps = [g.tp for g, row in zip(target, slots) for s in row if s is None]
        if not self.places_devices or not tps:
            return [], 0
        held = {s.addr: s.gpus for s in self.servers if s.alive()}
        try:
            names = servers_to_retire(self.rollout_devices, held, [s.addr for s in leaving if s.alive()], tps)
        except PlacementError as e:
            raise FleetError(f"reconfigure: {e}") from None
        retired = [s for s in leaving if s.addr in names]
        if not retired:
            return [], 0
        log.warning("fleet: the new servers need the devices of %s; stopping them first (break-before-make)",
                    [s.addr for s in retired])
        moved = sum(self.router.inflight(s.addr) for s in retired)
        for s in retired:
            self.router.remove_server(s.addr)  # in-flight requests there are moved within a watch interval
        with self._inner.lock:
            self._inner.addresses = [a for a in self._inner.addresses if a not in names]
        self._write_files(draining=retired)
        deadline = time.monotonic() + self.evict_timeout_s
        while any(self.router.inflight(s.addr) > 0 for s in retired) and time.monotonic() < deadline:
            time.sleep(0.1)
        for s in retired:
            s.stop()
        return retired, moved

    def _start_and_switch(self, target: list[RolloutGroup], slots: list[list[FleetServer | None]], path: str,
                          version: int) -> tuple[list[list[FleetServer]], list[FleetServer]]:
        """Start the empty slots' servers from `path`, then switch router and engine to `target`.
        Returns (servers per group, the new ones); on failure the new ones are stopped."""
        with self._pinned_checkpoint(path):
            new = self._start(target, slots, path, version)
            it = iter(new)
            rows = [[s if s is not None else next(it) for s in row] for row in slots]
            try:
                self._switch(target, rows, new, path, version)
            except BaseException:
                for s in new:
                    s.stop()
                raise
        for g, row in zip(target, rows):
            for s in row:
                s.group = g.name
        self.groups = target
        return rows, new

    def _restore(self, retired: list[FleetServer], path: str, version: int, cause: BaseException) -> None:
        """The new layout failed after servers were stopped to make room: start servers of the old layout
        on the freed devices again (as a revive would), then raise FleetError naming both."""
        what = ", ".join(s.addr for s in retired)
        try:
            slots, _ = self._plan(self.groups)  # the stopped servers' slots are empty
            rows, _ = self._start_and_switch(self.groups, slots, path, version)
        except BaseException as e:
            self._write_files()
            raise FleetError(f"{first_line(cause)}; the servers stopped to make room ({what}) could not be "
                             f"replaced either: {first_line(e)}") from cause
        self.router.forget([s.addr for s in retired])
        self.servers = [s for row in rows for s in row]
        self._write_files()
        raise FleetError(f"{first_line(cause)}; the old layout serves again (the servers stopped to make room, "
                         f"{what}, were replaced)") from cause

    def reconfigure(self, groups: Sequence[RolloutGroup] | None, step: int) -> dict:
        """Switch the rollout servers to `groups` (see the module doc); None: the layout in force when this
        call gets its turn (replace dead servers, without undoing a re-plan that ran meanwhile). Returns
        {"reconfig_s", "started", "stopped", "moved", "groups"} (xccl: also "pending": True while the new
        servers wait for the next weight update); raises FleetError (one line) with the old layout still
        serving, and records it in fleet.jsonl."""
        t0 = time.monotonic()
        before = list(self.groups)
        try:
            with self._reconf:
                if self.xccl:
                    out = self._reconfigure_xccl(groups, step, t0)
                else:
                    out = self._reconfigure_disk(groups, step, t0)
        except FleetError as e:
            self._log_event({"step": step, "failed": first_line(e), "transient": e.transient,
                             "groups": self._describe(groups)})
            raise
        if out.get("started") or out.get("stopped") or self.groups != before:
            log.info("fleet: step %d reconfigured to %s in %.1fs (started %s, stopped %s%s)", step, out["groups"],
                     out["reconfig_s"], out["started"], out["stopped"],
                     "; they serve from the next weight update" if out.get("pending") else "")
            self._log_event({"step": step, **out})
        return out

    def _describe(self, groups: Sequence[RolloutGroup] | None) -> str:
        try:
            return format_allocation(self.backend.name, list(self.groups if groups is None else groups))
        except (GroupConfigError, ValueError, AttributeError, TypeError):
            return repr(groups)

    def _log_event(self, rec: dict) -> None:
        if self.run_dir is not None:
            with contextlib.suppress(OSError):
                append_jsonl(self.run_dir / FLEET_LOG, {"step": rec.pop("step"), "t": round(time.time(), 3), **rec})

    def _noop(self, target: list[RolloutGroup], t0: float) -> dict:
        return {"reconfig_s": round(time.monotonic() - t0, 3), "started": [], "stopped": [], "moved": 0,
                "groups": format_allocation(self.backend.name, target)}

    def _reconfigure_disk(self, groups: Sequence[RolloutGroup] | None, step: int, t0: float) -> dict:
        target = self._validate(self.groups if groups is None else groups)
        slots, leaving = self._plan(target)
        if not leaving and all(s is not None for row in slots for s in row) and target == self.groups:
            return self._noop(target, t0)
        path, version = self.current_weights()
        retired, moved = self._make_room(target, slots, leaving)
        try:
            rows, new = self._start_and_switch(target, slots, path, version)
        except BaseException as e:
            if retired and isinstance(e, Exception):
                self._restore(retired, path, version, e)
            raise
        self.servers = [s for row in rows for s in row] + leaving
        self._write_files(draining=leaving)
        moved += self._drain(leaving)
        self.router.forget([s.addr for s in leaving])  # first: a stopped server is no health event
        for s in leaving:
            s.stop()
        self.servers = [s for row in rows for s in row]
        self._write_files()
        self.reconfigurations += 1
        return {"reconfig_s": round(time.monotonic() - t0, 3), "started": [s.addr for s in new],
                "stopped": [s.addr for s in leaving], "moved": moved,
                "groups": format_allocation(self.backend.name, target)}

    # --- xccl: new servers join the weight-update group at the next update, then serve ------------------
    def _reconfigure_xccl(self, groups: Sequence[RolloutGroup] | None, step: int, t0: float) -> dict:
        """Start the new servers on the base model now; the next weight update forms the group over the
        new set (patch 11's rank offsets), broadcasts the current weights to every member, and only then
        switches router and engine (_after_xccl_update). The old layout serves until then."""
        if self._pending is not None:
            if groups is None:  # a revive while a change waits: that change replaces what is dead
                out = self._noop(self._pending.target, t0)
                return out | {"pending": True}
            raise FleetError("reconfigure: the last change still waits for the next weight update (xccl)",
                             transient=True)
        target = self._validate(self.groups if groups is None else groups)
        slots, leaving = self._plan(target)
        if not leaving and all(s is not None for row in slots for s in row) and target == self.groups:
            return self._noop(target, t0)
        retired, moved = self._make_room(target, slots, leaving)
        try:
            new = self._start(target, slots, self.model_path, None)
        except FleetError as e:
            if retired:  # the stopped servers' slots of the old layout: started again, joining the same way
                try:
                    old_slots, _ = self._plan(self.groups)
                    back = self._start(self.groups, old_slots, self.model_path, None)
                except FleetError as e2:
                    raise FleetError(f"{first_line(e)}; the servers stopped to make room could not be replaced "
                                     f"either: {first_line(e2)}") from e
                it = iter(back)
                self._pending = _Pending(step, list(self.groups), [[s if s is not None else next(it) for s in row]
                                                                   for row in old_slots], back, [], t0)
                self.servers = self.servers + back
                self._write_files(starting=back)
                raise FleetError(f"{first_line(e)}; servers of the old layout replace those stopped to make room "
                                 "from the next weight update") from e
            raise
        it = iter(new)
        rows = [[s if s is not None else next(it) for s in row] for row in slots]
        staying = [s for s in leaving if s not in retired]
        self._pending = _Pending(step, target, rows, new, staying, t0, retired)
        self.servers = self.servers + new
        self._write_files(draining=retired, starting=new)
        return {"reconfig_s": round(time.monotonic() - t0, 3), "started": [s.addr for s in new],
                "stopped": [s.addr for s in retired], "moved": moved,
                "groups": format_allocation(self.backend.name, target), "pending": True}

    def _hook_xccl_updates(self) -> None:
        """Every xccl weight update of the train engine (rank 0) first brings the group in line with the
        servers that should get it, and lands a waiting reconfiguration right after."""
        eng = self.weight_group.engine
        orig = eng.update_weights
        self._orig_train_update = orig

        def update_weights(meta):
            if getattr(meta, "type", None) != "xccl":
                return orig(meta)
            with self._reconf:  # no reconfiguration or revive in the middle of an update
                self._before_xccl_update()
                out = orig(meta)
                self._after_xccl_update(meta)
            return out

        eng.update_weights = update_weights

    def _members(self) -> list[FleetServer]:
        """Who gets this update: the serving servers (dead or down ones left out), then a waiting change's
        new servers; a waiting change's leaving servers still serve, so they get it too."""
        down = self.router.down_addresses()
        p = self._pending
        if p is None:
            by_addr = {s.addr: s for s in self.servers}
            order = [by_addr[a] for a in self._inner.addresses if a in by_addr]
            order += [s for s in self.servers if s not in order]
        else:
            order = [s for row in p.rows for s in row] + p.leaving
        return [s for s in order if s.alive() and s.addr not in down]

    def _form_group(self) -> None:
        members = self._members()
        want = tuple((s.addr, s.tp) for s in members)
        if want and want != self.weight_group.members:
            self.weight_group.recreate([a for a, _ in want], [t for _, t in want])
        with self._inner.lock:
            self._inner.addresses = [a for a, _ in want] if want else self._inner.addresses

    def _before_xccl_update(self) -> None:
        try:
            self._form_group()
            return
        except WeightGroupError as e:
            p = self._pending
            if p is None:  # nothing to give up: the update goes to the old group (AReaL's own failure if broken)
                log.error("fleet: %s", first_line(e))
                self._log_event({"step": -1, "failed": first_line(e), "transient": False,
                                 "groups": self._describe(None)})
                return
            self._pending = None
            for s in p.new:
                s.stop()
            self.servers = [s for s in self.servers if s not in p.new]
            self._write_files()
            reason = f"the new servers did not join the weight-update group: {first_line(e)}"
            log.error("fleet: step %d change to %s abandoned, the old layout keeps serving: %s", p.step,
                      self._describe(p.target), reason)
            self._log_event({"step": p.step, "failed": reason, "transient": False,
                             "groups": self._describe(p.target)})
        try:
            self._form_group()  # without them (e.g. a server died meanwhile)
        except WeightGroupError as e:
            log.error("fleet: %s", first_line(e))

    def _after_xccl_update(self, meta) -> None:
        p, self._pending = self._pending, None
        if p is None:
            return
        addrs = [[s.addr for s in row] for row in p.rows]
        with self._inner.lock:
            self.router.set_layout(p.target, addrs)
            self._inner.addresses = [a for row in addrs for a in row]
        for g, row in zip(p.target, p.rows):
            for s in row:
                s.group = g.name
        self.groups = p.target
        serving = [s for row in p.rows for s in row]
        self.servers = serving + p.leaving
        self._write_files(draining=p.leaving)
        moved = self._drain(p.leaving)
        self.router.forget([s.addr for s in p.leaving + p.retired])
        for s in p.leaving:
            s.stop()
        self.servers = serving
        self._write_files()
        self.reconfigurations += 1
        self._log_event({"step": p.step, "landed": getattr(meta, "version", None), "started": [s.addr for s in p.new],
                         "stopped": [s.addr for s in p.leaving], "moved": moved,
                         "reconfig_s": round(time.monotonic() - p.t0, 3),
                         "groups": format_allocation(self.backend.name, p.target)})
        log.info("fleet: the change of step %d landed with weight version %s: %s", p.step,
                 getattr(meta, "version", None), format_allocation(self.backend.name, p.target))

    # --- files -----------------------------------------------------------------------------------------
    def _write_files(self, draining: Sequence[FleetServer] = (), starting: Sequence[FleetServer] = ()) -> None:
        if self.run_dir is None:
            return

        gone = {id(s) for s in draining}
        early = {id(s) for s in starting}
        body = {"servers": [s.record("draining" if id(s) in gone else "starting" if id(s) in early else "serving")
                            for s in self.servers]}
        atomic_write_text(self.run_dir / REGISTRY_FILE, json.dumps(body, indent=1) + "\n")
        by_group: dict[str, list[str]] = {}
        for s in self.servers:
            if id(s) not in gone and id(s) not in early:
                by_group.setdefault(s.group, []).append(s.addr)
        groups = [replace(g, count=len(by_group.get(g.name, []))) for g in self.groups]
        write_groups_file(self.run_dir, groups, [a for g in groups for a in by_group.get(g.name, [])])

    def close(self, stop_servers: bool = False) -> None:
        """Undo the weight-update hook and delete the kept checkpoint; optionally stop the servers the
        trainer started (the launcher stops the rest, and servers watch their parent process)."""
        if self._orig_update is not None:
            with contextlib.suppress(AttributeError):
                del self._inner.update_weights_from_disk
            self._orig_update = None
        if self._orig_train_update is not None:
            with contextlib.suppress(AttributeError):
                del self.weight_group.engine.update_weights
            self._orig_train_update = None
        with self._lock:
            w = self._weights
        if w.owned:
            shutil.rmtree(w.path, ignore_errors=True)
        if stop_servers:
            for s in self.servers:
                if s.owner == "trainer":
                    s.stop()


def read_registry(run_dir: str | Path) -> list[dict]:
    """The servers.json entries (empty when there is none or it cannot be read)."""
    try:
        return list(json.loads((Path(run_dir) / REGISTRY_FILE).read_text())["servers"])
    except (OSError, ValueError, KeyError, TypeError):
        return []


def write_registry(run_dir: str | Path, handles: Sequence[RunningServer], owner: str = "launcher") -> None:
    """The launcher's first registry: its servers before the trainer starts."""
    body = {"servers": [{"addr": h.addr, "group": h.spec.group, "tp": h.spec.tp, "pid": h.pid,
                         "owner": owner, "state": "serving", "log": h.log_path, "gpus": list(h.gpu_ids)}
                        for h in handles]}
    atomic_write_text(Path(run_dir) / REGISTRY_FILE, json.dumps(body, indent=1) + "\n")


def build_fleet(trainer, router, run_dir: str | Path, backend: ServerBackend | None = None, **kwargs) -> ServerFleet:
    """The fleet of a live run (areal_libra/live/train.py, after install_router): the launcher's
    servers from rollout_groups.json + servers.json, the model from the AReaL config; new servers start
    through `backend` (None: local processes, SGLang where libra.device is cuda, else embedded)."""

    run_dir = Path(run_dir)
    groups, addrs = read_groups_file(run_dir / GROUPS_FILE)
    reg = {r.get("addr"): r for r in read_registry(run_dir)}
    servers = [FleetServer(a, g.name, g.tp, g.threads, g.max_running, reg.get(a, {}).get("pid"),
                           gpus=tuple(str(d) for d in reg.get(a, {}).get("gpus") or ()))
               for g, row in zip(groups, addrs) for a in row]
    if backend is None:  # an emulated host the launch started, else local processes
        backend = EmulatedHostBackend.from_run_dir(run_dir)
    if backend is None:
        lc = load_run_config(run_dir) if (run_dir / "libra_config.yaml").exists() else None
        device = lc.device if lc is not None else "cpu"
        flags = libra_sglang_flags(trainer.config.sglang, lc is not None and lag_bounded(lc)) if device == "cuda" else ()  # as the launch's
        backend = backend_for_device(device, seed=int(getattr(trainer.config, "seed", 0) or 0),
                                     first_index=len(servers), areal_flags=flags)
    for s in servers:  # the launcher's servers, stopped and replaced through the backend that runs them
        h = backend.adopt(s.addr, ServerSpec(tp=s.tp, threads=s.threads, max_running=s.max_running, group=s.group),
                          str(run_dir))
        if h is not None:
            s.handle, s.backend = h, backend
    if getattr(backend, "drain_timeout_s", None) is not None:  # e.g. the emulated host: requests move at once
        kwargs.setdefault("drain_timeout_s", backend.drain_timeout_s)
    pool = [d.strip() for d in os.environ.get(ROLLOUT_DEVICES_ENV, "").split(",") if d.strip()]
    kwargs.setdefault("rollout_devices", pool)
    if str(getattr(trainer.config.actor, "weight_update_mode", "disk")) == "xccl" and "weight_group" not in kwargs:
        try:  # the group AReaL formed at connect_engine, re-formed when the server set changes
            kwargs["weight_group"] = WeightGroup(trainer.actor, trainer.rollout, trainer.weight_update_meta)
        except ValueError as e:
            raise FleetError(f"live reconfiguration under xccl: {e}") from None
    return ServerFleet(trainer.rollout, router, str(trainer.config.actor.path), run_dir / "servers", backend,
                       servers, groups, run_dir, **kwargs)
