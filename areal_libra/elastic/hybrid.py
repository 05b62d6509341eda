"""Hybrid-replica side: serve rollout, join training as a whole data-parallel replica, release.

Join, as this rank sees it (protocol keys in core.py):
 1. `cmd/<rid>` says join at generation g: drain the rollout server (in-flight requests are handed
    back, none lost) and ack.
 2. FETCHING (outside the domain: the core never waits for it): `fetch/<rid>/<g>` names the step s0
    whose snapshot the core publishes; fetch and verify it (refused files: ask for a fresh one and
    retry), load it, then replay the core's logged reduced gradients of steps >= its version.
 3. ZERO_SYNC: admitted to the domain; send zeros (weight 0) each step and keep the live reduced
    gradients, while replaying the rest of the log; once every step up to the live one is applied the
    replica is bitwise where the core is ("activating").
 4. TRAINING: the leader flips it; real gradients from that step on.
Release: the replica disappears from the plan; it leaves the domain and starts a rollout server with
its (current) weights.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

import torch

from areal_libra.elastic.core import RuntimeConfig
from areal_libra.elastic.domain import DomainError, GradientDomain
from areal_libra.elastic.kv import KV, connect
from areal_libra.elastic.replica import ReplicaAdapter
from areal_libra.elastic.snapshot import SnapshotError, SnapshotStore


class RolloutSide(Protocol):
    """The rollout server living on a hybrid replica's devices (see modeswitch.py)."""

    def start(self, replica: ReplicaAdapter) -> None:
        """Serve rollout with the replica's current weights."""
        ...

    def drain(self) -> list[Any]:
        """Stop admitting requests; return the in-flight ones, handed back to the dispatcher."""
        ...


class _Fetcher(threading.Thread):
    """Finds, verifies and decodes the snapshot off the main thread (the main thread keeps beating and
    watching for cancellation)."""

    def __init__(self, worker: HybridWorker, min_version: int, gen: int) -> None:
        super().__init__(name=f"fetch-{worker.rid}-{worker.rank}", daemon=True)
        self.w, self.min_version, self.gen = worker, min_version, gen
        self.result: tuple[int, dict[str, Any]] | None = None
        self.error: str | None = None
        self.refused: list[str] = []
        self.cancel = threading.Event()

    def run(self) -> None:
        w = self.w
        kv = KV(connect(w.host, w.port), w.cfg.namespace)
        minv = self.min_version
        deadline = time.monotonic() + w.cfg.plan_timeout_s
        while not self.cancel.is_set():
            v = w.snapshots.latest(w.rank, minv)
            if v is None:
                if time.monotonic() > deadline:
                    self.error = f"no snapshot >= v{minv} appeared"
                    return
                time.sleep(0.01)
                continue
            if w.cfg.fetch_delay_s and self.cancel.wait(w.cfg.fetch_delay_s):
                return
            try:
                self.result = (v, w.snapshots.fetch(v, w.rank))
                return
            except SnapshotError as e:
                self.refused.append(str(e))
                w.log(f"snapshot refused, retrying: {e}")
                if len(self.refused) > w.cfg.fetch_retries:
                    self.error = f"gave up after {len(self.refused)} refused snapshots; last: {e}"
                    return
                kv.add(f"snapreq/{w.rid}/{self.gen}")  # ask the leader for a fresh version
                minv = v + 1


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
                                     namespace=f"{cfg.namespace}/dom")
        self.start_active = start_active  # (step, generation): static member from `step` (reference runs)
        self.verbose = verbose
        self.events: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self.gen = 0
        self.handled_gen = 0
        self.in_domain = False
        self.version: int | None = None  # next step whose reduced gradient this replica must apply
        self.live: dict[int, torch.Tensor] = {}  # reduced gradients received in the domain, not applied yet
        self.steps_trained = 0
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

    def _report(self, state: str, **kw: Any) -> None:
        self.kv.set(f"prog/{self.rid}/{self.rank}", {"gen": self.gen, "state": state, "t": time.time(), **kw})

    def _shutdown(self) -> bool:
        return self.kv.has("shutdown")

    # -- mode switches ---------------------------------------------------------------------------
    def _to_rollout(self, why: str) -> None:
        self.domain.close()
        self.domain.epoch = None
        self.in_domain = False
        self.version = None
        self.live.clear()
        self.grads_for = None
        if self.rollout is not None:
            self.rollout.start(self.replica)
        cmd = self.kv.get(f"cmd/{self.rid}") or {}
        self.gen = int(cmd.get("gen", self.gen))
        self._report("rollout", why=why)
        self.log(f"back to rollout ({why})")

    def _join(self, gen: int) -> None:
        handed = self.rollout.drain() if self.rollout is not None else []
        self.gen = self.handled_gen = gen
        self.kv.set(f"handback/{self.rid}/{gen}/{self.rank}", handed)
        self.kv.add(f"ack/{self.rid}/{gen}")
        self.log(f"join gen {gen}: drained rollout, handed back {len(handed)} requests")

    # -- catching up -----------------------------------------------------------------------------
    def _flat(self) -> torch.Tensor:
        return torch.cat([g.reshape(-1) for g in self.replica.grad_tensors()]).clone()

    def _set_flat(self, flat: torch.Tensor) -> None:
        off = 0
        for g in self.replica.grad_tensors():
            g.copy_(flat[off:off + g.numel()].view_as(g))
            off += g.numel()

    def _catch_up(self) -> None:
        """Apply, in step order, every reduced gradient this replica lacks: live ones received in the
        domain first, else the core's log on disk; stop at the first gap (not logged yet)."""
        while self.version is not None:
            g = self.live.pop(self.version, None)
            if g is None:
                g = self.snapshots.read_grad(self.version, self.rank)
            if g is None:
                return
            self._set_flat(g)
            self.replica.apply_update()
            self.version += 1

    def _fetch_and_load(self, s0: int) -> bool:
        """FETCHING: returns False when the join was cancelled, failed or shut down."""
        f = _Fetcher(self, min_version=s0, gen=self.gen)
        f.start()
        while f.is_alive():
            f.join(0.05)
            if self._cancelled() or self._shutdown():
                f.cancel.set()
                return False
        if f.error is not None or f.result is None:
            self._report("failed", error=f.error or "fetch cancelled")
            self.log(f"fetch failed: {f.error}")
            return False
        version, state = f.result
        self.replica.load_state(state)
        self.version = version
        self._catch_up()
        self._report("loaded", version=self.version, snapshot=version, refused=len(f.refused))
        self.log(f"loaded snapshot v{version} ({len(f.refused)} refused), replayed to v{self.version}")
        return True

    def _cancelled(self) -> bool:
        cmd = self.kv.get(f"cmd/{self.rid}") or {}
        return int(cmd.get("gen", self.gen)) != self.gen

    # -- main loop -------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        self.kv.set(f"hb/{self.rid}/{self.rank}", time.time())
        self._report("rollout" if self.start_active is None else "training")
        hb = threading.Thread(target=self._heartbeat, daemon=True)
        hb.start()
        try:
            self._loop()
        finally:
            self._stop.set()
            if self.rollout is not None and not self.in_domain:
                self.rollout.drain()  # hand unfinished requests back rather than dropping them
        return {"events": self.events, "steps_trained": self.steps_trained}

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
                    s = int(self.kv.wait("cur_step", self.cfg.plan_timeout_s))
                    continue
                if self._shutdown():
                    return
                time.sleep(0.005)
                continue
            if not self.in_domain:
                # Loaded, waiting to be admitted: keep replaying the log, look for our name in the plan.
                self._catch_up()
                plan = self.kv.get(f"plan/{s}")
                if plan is None:
                    if self._cancelled():
                        self._to_rollout("join cancelled")
                        s = None
                    time.sleep(0.002)
                    continue
                if plan.get("shutdown"):
                    return
                if plan["gens"].get(self.rid) != self.gen:
                    s += 1
                    continue
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
            if self.version is not None and self.version < s:
                self._catch_up()
                if self.version == s:
                    self._report("activating", version=self.version)
                    self.log(f"aligned at v{self.version}")

    def _step(self, s: int, plan: dict[str, Any]) -> bool:
        """One domain step (with retries); False when this replica left the domain."""
        while True:
            training = plan["states"][self.rid] == "training"
            weight = 0.0
            if training:
                if self.grads_for != s:
                    self.cur_weight = self.replica.compute_gradients(s)
                    self.grads_for = s
                weight = self.cur_weight
            else:
                for g in self.replica.grad_tensors():
                    g.zero_()
            saved = self._flat() if training else None
            ok = True
            try:
                if plan["epoch"] != self.domain.epoch or self.domain.group is None:
                    self.domain.rebuild(plan["epoch"], plan["members"])
                self.domain.reduce(self.replica.grad_tensors(), weight)
            except DomainError as e:
                ok = False
                self.log(f"step {s} attempt {plan['attempt']} failed: {e}")
            res = self.kv.wait(f"result/{s}/{plan['attempt']}", self.cfg.plan_timeout_s, abort=self._shutdown)
            if res is None:
                self._stop.set()
                return False
            if res == "commit":
                if not ok:  # the core went on without us: we are out of step, so leave cleanly
                    self._report("failed", error=f"missed commit of step {s}")
                    self._to_rollout("missed a committed step")
                    return False
                if training:
                    if self.version is not None and self.version != s:
                        raise RuntimeError(f"{self.rid}: training step {s} at version {self.version}")
                    self.replica.apply_update()
                    self.steps_trained += 1
                    self.grads_for = None
                    if self.version is not None:
                        self.version = s + 1
                else:
                    self.live[s] = self._flat()
                return True
            failed_attempt = plan["attempt"]
            plan = self.kv.get(f"plan/{s}")
            while plan["attempt"] <= failed_attempt:  # the leader writes the next plan before "retry"
                time.sleep(0.002)
                plan = self.kv.get(f"plan/{s}")
            if plan["gens"].get(self.rid) != self.gen:
                self._to_rollout("dropped from the domain after a failed step")
                return False
            if saved is not None:
                self._set_flat(saved)
                self.grads_for = s
