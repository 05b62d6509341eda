"""Hybrid-replica side: serve rollout, join training as a whole data-parallel replica, release.

Join, as this rank sees it (protocol keys in core.py):
 1. `cmd/<rid>` says join at generation g: drain the rollout server (in-flight requests are handed
    back, none lost), ack, and wait for the first plan that lists this replica.
 2. FETCHING: enter the gradient domain with weight 0 (zeros), keep every committed reduced gradient
    in a replay log, and fetch the snapshot of the first domain step s0 on a background thread.
 3. ZERO_SYNC: load the snapshot (version v >= s0), replay the logged gradients of steps >= v through
    the same optimizer update as the core: the replica is now bitwise where the core is.
 4. ACTIVATING -> TRAINING: the leader flips it; it contributes real gradients from that step on.
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
            if w.cfg.fetch_delay_s:
                self.cancel.wait(w.cfg.fetch_delay_s)
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
        self.loaded = False
        self.log_buf: list[tuple[int, torch.Tensor]] = []
        self.fetcher: _Fetcher | None = None
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
        if self.fetcher is not None:
            self.fetcher.cancel.set()
            self.fetcher = None
        self.domain.close()
        self.domain.epoch = None
        self.in_domain = self.loaded = False
        self.log_buf.clear()
        self.grads_for = None
        if self.rollout is not None:
            self.rollout.start(self.replica)
        cmd = self.kv.get(f"cmd/{self.rid}") or {}
        self.gen = int(cmd.get("gen", self.gen))
        self._report("rollout", why=why)
        self.log(f"back to rollout ({why})")

    def _join(self, gen: int) -> int:
        handed = self.rollout.drain() if self.rollout is not None else []
        self.gen = self.handled_gen = gen
        self.kv.set(f"handback/{self.rid}/{gen}/{self.rank}", handed)
        self.kv.add(f"ack/{self.rid}/{gen}")
        self.log(f"join gen {gen}: drained rollout, handed back {len(handed)} requests")
        return int(self.kv.wait("cur_step", self.cfg.plan_timeout_s))

    # -- zero-sync bookkeeping -------------------------------------------------------------------
    def _flat(self) -> torch.Tensor:
        return torch.cat([g.reshape(-1) for g in self.replica.grad_tensors()]).clone()

    def _set_flat(self, flat: torch.Tensor) -> None:
        off = 0
        for g in self.replica.grad_tensors():
            g.copy_(flat[off:off + g.numel()].view_as(g))
            off += g.numel()

    def _poll_fetch(self) -> None:
        f = self.fetcher
        if f is None or f.is_alive():
            return
        self.fetcher = None
        if f.error is not None:
            self._report("failed", error=f.error)
            self.log(f"fetch failed: {f.error}")
            return
        assert f.result is not None
        version, state = f.result
        self.replica.load_state(state)
        self._report("zero_sync", version=version, refused=len(f.refused))
        # Replay every logged reduced gradient the snapshot does not already contain.
        pending = [(s, g) for s, g in self.log_buf if s >= version]
        if pending and pending[0][0] != version:
            self._report("failed", error=f"replay gap: snapshot v{version}, log starts at {pending[0][0]}")
            return
        for _s, g in pending:
            self._set_flat(g)
            self.replica.apply_update()
        self.log_buf.clear()
        self.loaded = True
        self._report("activating", version=version + len(pending))
        self.log(f"loaded snapshot v{version}, replayed {len(pending)} steps")

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
            self.in_domain = self.loaded = True
        elif self.rollout is not None:
            self.rollout.start(self.replica)
        while not self._stop.is_set():
            if s is None:  # serving rollout: wait for a join command
                cmd = self.kv.get(f"cmd/{self.rid}")
                if cmd and cmd["op"] == "join" and int(cmd["gen"]) > self.handled_gen:
                    s = self._join(int(cmd["gen"]))
                    continue
                if self._shutdown():
                    return
                time.sleep(0.005)
                continue
            plan = self.kv.wait(f"plan/{s}", self.cfg.plan_timeout_s, abort=self._shutdown)
            if plan is None or plan.get("shutdown"):
                return
            if plan["gens"].get(self.rid) != self.gen:
                if self.in_domain:
                    self._to_rollout("left the domain")
                    s = None
                    continue
                cmd = self.kv.get(f"cmd/{self.rid}") or {}
                if int(cmd.get("gen", self.gen)) != self.gen:  # join cancelled before we got in
                    self._to_rollout("join cancelled")
                    s = None
                    continue
                s += 1  # not admitted yet: the leader admits at the next boundary after the ack
                continue
            if not self.in_domain:
                self.in_domain = True
                self.fetcher = _Fetcher(self, min_version=s, gen=self.gen)
                self.fetcher.start()
                self.log(f"entered domain at step {s}, fetching snapshot >= v{s}")
            if not self._step(s, plan):
                s = None
                continue
            s += 1
            self._poll_fetch()

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
                    self.replica.apply_update()
                    self.steps_trained += 1
                    self.grads_for = None
                elif self.loaded:
                    self.replica.apply_update()
                else:
                    self.log_buf.append((s, self._flat()))
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
