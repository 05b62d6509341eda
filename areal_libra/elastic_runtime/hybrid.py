"""Hybrid-replica side: serve rollout, join training as a whole data-parallel replica, release.

Join, as this rank sees it (protocol keys in core.py):
 1. `cmd/<rid>` says join at generation g: drain the rollout server (in-flight requests are handed
    back, none lost) and ack.
 2. FETCHING (the core never waits for it): `fetch/<rid>/<g>` names the step s0 whose snapshot the core
    publishes; the catch-up thread (low priority, see priority.py) fetches and verifies it (refused
    files: ask for a fresh one and retry), loads it, then replays the core's logged reduced gradients.
 3. ZERO_SYNC: on its side channel (a group of the core and this replica only) the main thread sends
    zeros with weight 0 after each committed step and receives the step's reduced gradient; the
    catch-up thread applies them in order; once every step up to the live one is applied the replica
    is bitwise where the core is ("activating"). It is never in the core's all-reduce before that.
 4. TRAINING: the leader puts it in the domain; real gradients from that step on.
Release: the replica disappears from the plan; it leaves the domain and starts a rollout server with
its (current) weights.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

import torch

from areal_libra.elastic_runtime.core import CORE, RuntimeConfig
from areal_libra.elastic_runtime.domain import DomainError, GradientDomain
from areal_libra.elastic_runtime.kv import KV, connect
from areal_libra.elastic_runtime.priority import enter_background
from areal_libra.elastic_runtime.replica import ReplicaAdapter
from areal_libra.elastic_runtime.snapshot import SnapshotError, SnapshotStore


class RolloutSide(Protocol):
    """The rollout server living on a hybrid replica's devices (see modeswitch.py)."""

    def start(self, replica: ReplicaAdapter) -> None:
        """Serve rollout with the replica's current weights."""
        ...

    def drain(self) -> list[Any]:
        """Stop admitting requests; return the in-flight ones, handed back to the dispatcher."""
        ...


class _CatchUp(threading.Thread):
    """A joiner's bulk work, at low priority (`priority.enter_background`): find, verify and decode the
    snapshot, load it and replay the core's logged reduced gradients up to the step that was current
    when it loaded (a bounded amount of work: a starved thread never chases a moving log head). The
    main thread, idle until then, waits; from "loaded" on it applies the remaining steps itself, at
    normal priority, one optimizer step per core step like the training it is about to join."""

    def __init__(self, worker: HybridWorker, min_version: int, gen: int) -> None:
        super().__init__(name=f"catchup-{worker.rid}-{worker.rank}", daemon=True)
        self.w, self.min_version, self.gen = worker, min_version, gen
        self.loaded = threading.Event()
        self.error: str | None = None
        self.refused: list[str] = []
        self.cancel = threading.Event()

    def run(self) -> None:
        enter_background()
        w = self.w
        kv = KV(connect(w.host, w.port), w.cfg.namespace)
        try:
            fetched = self._fetch(kv)
            if fetched is None:
                return
            version, state = fetched
            head = kv.get("cur_step")
            with w.lock:
                w.replica.load_state(state)
                w.version = version
                w.catch_up(until=int(head) if head is not None else None, cancel=self.cancel)
            del state
            if self.cancel.is_set():
                return
            w.report("loaded", kv=kv, gen=self.gen, version=w.version, snapshot=version, refused=len(self.refused))
            w.log(f"loaded snapshot v{version} ({len(self.refused)} refused), replayed to v{w.version}")
            self.loaded.set()
        except Exception as e:  # noqa: BLE001 - the main thread reports the failure
            self.error = f"catch-up failed: {e}"

    def _fetch(self, kv: KV) -> tuple[int, dict[str, Any]] | None:
        w = self.w
        minv = self.min_version
        deadline = time.monotonic() + w.cfg.plan_timeout_s
        while not self.cancel.is_set():
            v = w.snapshots.latest(w.rank, minv)
            if v is None:
                if time.monotonic() > deadline:
                    self.error = f"no snapshot >= v{minv} appeared"
                    return None
                self.cancel.wait(0.01)
                continue
            if w.cfg.fetch_delay_s and self.cancel.wait(w.cfg.fetch_delay_s):
                return None
            try:
                return v, w.snapshots.fetch(v, w.rank)
            except SnapshotError as e:
                self.refused.append(str(e))
                w.log(f"snapshot refused, retrying: {e}")
                if len(self.refused) > w.cfg.fetch_retries:
                    self.error = f"gave up after {len(self.refused)} refused snapshots; last: {e}"
                    return None
                kv.add(f"snapreq/{w.rid}/{self.gen}")  # ask the leader for a fresh version
                minv = v + 1
        return None


class HybridWorker:
    def __init__(
        self, host: str, port: int, cfg: RuntimeConfig, rid: str, rank: int, snapshot_root: str,
        replica: ReplicaAdapter, rollout: RolloutSide | None = None, start_active: tuple[int, int] | None = None,
        verbose: bool = False,
    ) -> None:
        self.host, self.port, self.cfg = host, port, cfg
        self.rid, self.rank = rid, rank
        self.replica = replica
        self.rollout = rollout
        self.kv = KV(connect(host, port), cfg.namespace)
        self.snapshots = SnapshotStore(snapshot_root, keep=cfg.snapshot_keep)
        self.domain = GradientDomain(self.kv.store, position=rank, me=rid, timeout_s=cfg.domain_timeout_s,
                                     chunk_elems=cfg.chunk_elems, backend=cfg.backend,
                                     namespace=f"{cfg.namespace}/dom",
                                     store_factory=lambda: connect(host, port, timeout_s=max(30.0, cfg.domain_timeout_s)))
        # Zero-sync: the side channel to the core's background sender (see core.py), never the domain.
        self.side = GradientDomain(self.kv.store, position=rank, me=rid, timeout_s=cfg.domain_timeout_s,
                                   chunk_elems=cfg.chunk_elems, backend=cfg.backend,
                                   namespace=f"{cfg.namespace}/side/{rid}")
        self.start_active = start_active  # (step, generation): static member from `step` (reference runs)
        self.verbose = verbose
        self.events: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self.gen = 0
        self.handled_gen = 0
        self.in_domain = False
        self.version: int | None = None  # next step whose reduced gradient this replica must apply
        self.live: dict[int, torch.Tensor] = {}  # reduced gradients received in the domain, not applied yet
        self.aligned = False  # reported "activating" in this join
        self.next_step: int | None = None  # the next domain step of the main thread (catch-up target)
        self.lock = threading.Lock()  # replica state: the catch-up thread and the main thread
        self.catchup: _CatchUp | None = None
        self.numel = sum(g.numel() for g in replica.grad_tensors())
        self.steps_trained = 0
        self.join_cpu_s: list[float] = []
        self._join_cpu0 = 0.0
        self.grads_for: int | None = None
        self.cur_weight = 0.0

    def log(self, msg: str) -> None:
        self.events.append({"t": time.time(), "msg": msg})
        if self.verbose:
            print(f"[{self.rid}/{self.rank}] {msg}", flush=True)

    def _heartbeat(self) -> None:
        kv = KV(connect(self.host, self.port), self.cfg.namespace)
        while not self._stop.is_set():
            kv.set(f"hb/{self.rid}/{self.rank}", time.time())
            self._stop.wait(self.cfg.heartbeat_interval_s)

    def report(self, state: str, kv: KV | None = None, gen: int | None = None, **kw: Any) -> None:
        """Progress for the leader; threads other than the main one pass their own store connection."""
        (kv or self.kv).set(f"prog/{self.rid}/{self.rank}",
                            {"gen": self.gen if gen is None else gen, "state": state, "t": time.time(), **kw})

    def _shutdown(self) -> bool:
        return self.kv.has("shutdown")

    # -- mode switches ---------------------------------------------------------------------------
    def _stop_catchup(self) -> None:
        c, self.catchup = self.catchup, None
        if c is not None:
            c.cancel.set()
            c.join()

    def _to_rollout(self, why: str) -> None:
        self._stop_catchup()
        self.domain.close()
        self.domain.epoch = None
        self.side.close()
        self.side.epoch = None
        self.in_domain = False
        self.version = None
        self.live.clear()
        self.grads_for = None
        if self.rollout is not None:
            self.rollout.start(self.replica)
        cmd = self.kv.get(f"cmd/{self.rid}") or {}
        self.gen = int(cmd.get("gen", self.gen))
        self.report("rollout", why=why)
        self.log(f"back to rollout ({why})")

    def _join(self, gen: int) -> None:
        handed = self.rollout.drain() if self.rollout is not None else []
        self.gen = self.handled_gen = gen
        self.kv.set(f"handback/{self.rid}/{gen}/{self.rank}", handed)
        self.kv.add(f"ack/{self.rid}/{gen}")
        self._join_cpu0 = time.process_time()
        self.log(f"join gen {gen}: drained rollout, handed back {len(handed)} requests")

    # -- catching up -----------------------------------------------------------------------------
    def _set_flat(self, flat: torch.Tensor) -> None:
        off = 0
        for g in self.replica.grad_tensors():
            g.copy_(flat[off:off + g.numel()].view_as(g))
            off += g.numel()

    def catch_up(self, until: int | None = None, cancel: threading.Event | None = None) -> None:
        """Apply, in step order, every reduced gradient this replica lacks (up to version `until`): live
        ones received on the side channel first, else the core's log on disk; stop at the first gap
        (not logged yet). Hold `lock`."""
        while self.version is not None and (until is None or self.version < until):
            if cancel is not None and cancel.is_set():
                return
            g = self.live.pop(self.version, None)
            if g is None:
                g = self.snapshots.read_grad(self.version, self.rank)
            if g is None:
                return
            self._set_flat(g)
            self.replica.apply_update()
            self.version += 1

    def _advance(self) -> None:
        """Main thread, between steps while joining: apply what is available; report "activating" once
        the replica holds the live version (the leader then puts it in the domain)."""
        with self.lock:
            self.catch_up()
        if self.in_domain and self.version is not None and self.version == self.next_step and not self.aligned:
            self.aligned = True
            self.report("activating", version=self.version)
            self.log(f"aligned at v{self.version}")

    def _fetch_and_load(self, s0: int) -> bool:
        """FETCHING: start the catch-up thread; True once it loaded the snapshot, False when the join was
        cancelled, failed or shut down."""
        c = self.catchup = _CatchUp(self, min_version=s0, gen=self.gen)
        c.start()
        while not c.loaded.wait(0.05):
            if not c.is_alive() and c.loaded.is_set():
                break  # it loaded and ended between the two checks
            if not c.is_alive() or self._cancelled() or self._shutdown():
                self._stop_catchup()
                if not (self._cancelled() or self._shutdown()):
                    self.report("failed", error=c.error or "fetch cancelled")
                    self.log(f"fetch failed: {c.error}")
                return False
        self._stop_catchup()  # it ends right after "loaded"
        self.aligned = False
        return True

    def _cancelled(self) -> bool:
        cmd = self.kv.get(f"cmd/{self.rid}") or {}
        return int(cmd.get("gen", self.gen)) != self.gen

    # -- main loop -------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        self.kv.set(f"hb/{self.rid}/{self.rank}", time.time())
        self.report("rollout" if self.start_active is None else "training")
        hb = threading.Thread(target=self._heartbeat, daemon=True)
        hb.start()
        try:
            self._loop()
        finally:
            self._stop.set()
            if self.rollout is not None and not self.in_domain:
                self.rollout.drain()  # hand unfinished requests back rather than dropping them
        return {"events": self.events, "steps_trained": self.steps_trained, "join_cpu_s": self.join_cpu_s}

    def _loop(self) -> None:
        s: int | None = None
        if self.start_active is not None:
            s, self.gen = self.start_active
            self.in_domain = True
        elif self.rollout is not None:
            self.rollout.start(self.replica)
        while not self._stop.is_set():
            if s is None:  # serving rollout: wait for a join command
                cmd = self.kv.get(f"cmd/{self.rid}")
                if cmd and cmd["op"] == "join" and int(cmd["gen"]) > self.handled_gen:
                    self._join(int(cmd["gen"]))
                    s0 = self.kv.wait(f"fetch/{self.rid}/{self.gen}", self.cfg.plan_timeout_s,
                                      abort=lambda: self._cancelled() or self._shutdown())
                    if s0 is None or not self._fetch_and_load(int(s0)):
                        if self._shutdown():
                            return
                        self._to_rollout("join cancelled or failed")
                        continue
                    # Walk the plans from the first step this replica lacks: the step that admits it
                    # (the first naming its generation) is the same for all its ranks, whenever each
                    # loaded. (It cannot lie before: admission waits for every rank's "loaded".)
                    s = int(self.version) if self.version is not None else int(self.kv.wait("cur_step", 60.0))
                    continue
                if self._shutdown():
                    return
                # The leader reads acks at step boundaries, so 20 ms of latency here costs nothing, and
                # an idle pool does not keep a CPU busy polling the store.
                time.sleep(0.02)
                continue
            if not self.in_domain:
                # Loaded: replay what the log has meanwhile, and wait for our name in a plan.
                self._advance()
                plan = self.kv.wait(f"plan/{s}", self.cfg.plan_timeout_s, poll_s=1.0,
                                    abort=lambda: self._cancelled() or self._shutdown())
                if plan is None:
                    if self._shutdown():
                        return
                    self._to_rollout("join cancelled")
                    s = None
                    continue
                if plan.get("shutdown"):
                    return
                if plan["gens"].get(self.rid) != self.gen:
                    s += 1
                    continue
                self.next_step = s
                self.in_domain = True
                self.log(f"entered domain at step {s} (replayed to v{self.version})")
            plan = self.kv.wait(f"plan/{s}", self.cfg.plan_timeout_s, abort=self._shutdown)
            if plan is None or plan.get("shutdown"):
                return
            if plan["gens"].get(self.rid) != self.gen:
                self._to_rollout("left the domain")
                s = None
                continue
            if not self._step(s, plan):
                s = None
                continue
            s += 1
            self.next_step = s
            if self.version is not None and self.version < s:
                self._advance()

    def _side_step(self, s: int, plan: dict[str, Any]) -> bool:
        """Zero-sync step s: send zeros with weight 0 on the side channel once the core announces the
        committed step; receive its reduced gradient into a fresh buffer, applied in order by
        `_advance`. False when this replica left."""
        go = self.kv.wait(f"sidego/{s}/{self.rid}/p{self.rank}", self.cfg.plan_timeout_s, poll_s=1.0,
                          abort=lambda: self._shutdown() or self._cancelled())
        if go is None:
            if self._shutdown():
                self._stop.set()
            else:
                self._to_rollout("join cancelled in zero-sync")
            return False
        try:
            if self.side.epoch != self.gen or self.side.group is None:
                self.side.rebuild(self.gen, (CORE, self.rid))
            flat, _ = self.side.reduce_flat([], 0.0, numel=self.numel)
        except DomainError as e:
            self.report("failed", error=f"side channel at step {s}: {e}")
            self._to_rollout("side channel failed")
            return False
        self.live[s] = flat
        return True

    def _step(self, s: int, plan: dict[str, Any]) -> bool:
        """One domain step (with retries); False when this replica left the domain.

        A training step first takes over the catch-up at normal priority, so that it computes at
        exactly version s."""
        if self.rid in plan.get("side", ()):
            return self._side_step(s, plan)
        while True:
            training = plan["states"][self.rid] == "training"
            weight = 0.0
            if training:
                if self.version is not None and self.version < s:
                    with self.lock:
                        self.catch_up()
                if self.aligned:
                    self.aligned = False
                    # CPU this process spent on the join (all threads: fetch, verify, replay, side channel).
                    self.join_cpu_s.append(time.process_time() - self._join_cpu0)
                if self.grads_for != s:
                    self.cur_weight = self.replica.compute_gradients(s)
                    self.grads_for = s
                weight = self.cur_weight
            ok = True
            flat = None
            try:
                if plan["epoch"] != self.domain.epoch or self.domain.group is None:
                    # Abandon the rendezvous as soon as the core gave this attempt up (a member died):
                    # waiting out the gloo timeout would make this replica miss the retry as well.
                    result_key = f"result/{s}/{plan['attempt']}"
                    self.domain.prepare(plan["epoch"], plan["members"])
                    self.domain.rebuild(plan["epoch"], plan["members"],
                                        abort=lambda k=result_key: "the core gave up this attempt" if self.kv.has(k) else None)
                if training:
                    flat, _ = self.domain.reduce_flat(self.replica.grad_tensors(), weight)
                else:
                    flat, _ = self.domain.reduce_flat([], 0.0, numel=self.numel)
            except DomainError as e:
                ok = False
                self.log(f"step {s} attempt {plan['attempt']} failed: {e}")
            res = self.kv.wait(f"result/{s}/{plan['attempt']}", self.cfg.plan_timeout_s, abort=self._shutdown)
            if res is None:
                self._stop.set()
                return False
            if res == "commit":
                if not ok:  # the core went on without us: we are out of step, so leave cleanly
                    self.report("failed", error=f"missed commit of step {s}")
                    self._to_rollout("missed a committed step")
                    return False
                assert flat is not None
                if training:
                    if self.version is not None and self.version != s:
                        raise RuntimeError(f"{self.rid}: training step {s} at version {self.version}")
                    GradientDomain.scatter(flat, self.replica.grad_tensors())
                    self.replica.apply_update()
                    self.steps_trained += 1
                    self.grads_for = None
                    if self.version is not None:
                        self.version = s + 1
                else:
                    self.live[s] = flat
                return True
            failed_attempt = plan["attempt"]
            plan = self.kv.get(f"plan/{s}")
            while plan["attempt"] <= failed_attempt:  # the leader writes the next plan before "retry"
                time.sleep(0.002)
                plan = self.kv.get(f"plan/{s}")
            if plan["gens"].get(self.rid) != self.gen:
                self._to_rollout("dropped from the domain after a failed step")
                return False
