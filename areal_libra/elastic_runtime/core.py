"""Core-replica side of the Elastic Hybrid Pool: the per-step plan, the domain reduction, failure handling.

Every core rank calls `ElasticCore.reduce_gradients(step, tensors, weight)` once per step, between
backward and the optimizer step. Core rank 0 is the leader: at each step boundary it reads the hybrid
replicas' reports from the store, advances the pool's state machine, decides the domain membership for
the step and writes it as `plan/<step>`. Protocol keys (under the namespace):

    cmd/<rid>              leader -> hybrid  {"op": "join"|"release", "gen": g}
    ack/<rid>/<g>          hybrid -> leader  rollout drained (handed-back requests), ready to enter the domain
    prog/<rid>/<rank>      hybrid -> leader  {"gen", "state", "version", "t"}
    hb/<rid>/<rank>        hybrid heartbeat  wall time, every heartbeat_interval_s
    snapreq/<rid>/<g>      hybrid -> leader  count of refused snapshots: publish a fresh one
    plan/<step>            leader -> all     {"attempt", "epoch", "members", "side", "states", "gens", "snapshot"}
    result/<step>/<a>      leader -> hybrids "commit" | "retry"
    sidego/<step>/<rid>/p<pos>  core -> joiner  the committed step's gradient goes out on <rid>'s side channel
    cur_step, shutdown

The core's own process groups are never touched: the only core-group collective here is a MIN of a
success flag, so that all core ranks retry or commit a step together.

Per shard position: the domain (`members`: the core and the training hybrids), rebuilt only on
membership changes, whose all-reduce is on the training thread's critical path; and one side channel
per zero-sync joiner (`side`: a two-member group, core and joiner, per joiner generation). A joiner never
enters the core's all-reduce: after each committed step a background thread of the core all-reduces
the step's result with weight 1 over each joiner's side channel while the joiner sends zeros with weight
0, so it receives exactly the committed gradient and the core never waits for it. A joiner that is
slow, descheduled or dead in zero-sync costs the core nothing (nor the other joiners: separate groups);
it enters the domain once it reported that it holds the live version.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from areal_libra.elastic.state import CATCHING_UP, IN_DOMAIN, HybridReplica, Pool, ReplicaState
from areal_libra.elastic_runtime.domain import DomainError, GradientDomain
from areal_libra.elastic_runtime.kv import KV, connect
from areal_libra.elastic_runtime.priority import enter_background
from areal_libra.elastic_runtime.settings import RuntimeConfig
from areal_libra.elastic_runtime.snapshot import SnapshotStore

CORE = "core"


class ElasticCore:
    def __init__(
        self,
        store: Any,
        cfg: RuntimeConfig,
        core_rank: int,
        core_size: int,
        core_group: Any,
        snapshot_root: str,
        state_fn: Callable[[], dict[str, Any]],
        hybrids: list[tuple[str, int]] | None = None,
        core_rollout_servers: int = 0,
        initially_training: tuple[str, ...] = (),
        corrupt_snapshots: list[str] | None = None,
    ) -> None:
        self.cfg = cfg
        self.kv = KV(store, cfg.namespace)
        self.rank = core_rank
        self.core_size = core_size
        self.core_group = core_group
        self.is_leader = core_rank == 0
        self.state_fn = state_fn
        self.snapshots = SnapshotStore(snapshot_root, keep=cfg.snapshot_keep)
        self.domain = GradientDomain(store, position=core_rank, me=CORE, timeout_s=cfg.domain_timeout_s,
                                     chunk_elems=cfg.chunk_elems, backend=cfg.backend,
                                     namespace=f"{cfg.namespace}/dom", store_factory=_store_factory(store, cfg))
        self.pool = Pool(1, core_rollout_servers, [HybridReplica(rid, n) for rid, n in (hybrids or [])])
        for rid in initially_training:  # static members (reference runs): trained from the start
            h = self.pool.hybrid[rid]
            h.state, h.generation = ReplicaState.TRAINING, 1
        if self.is_leader:
            for rid in initially_training:  # static members must be up before the first step counts them
                for k in range(self.pool.hybrid[rid].n_ranks):
                    self.kv.wait(f"hb/{rid}/{k}", cfg.plan_timeout_s)
        self.corrupt = list(corrupt_snapshots or [])  # fault injection: applied to successive publishes
        self.epoch = 0
        self.members: tuple[str, ...] = ()
        self.side = _SideSender(store, core_rank, cfg, self.kv.ns)
        self.snapreq_seen: dict[str, int] = {}
        self.t_request: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.events: list[dict[str, Any]] = []
        self.published: list[int] = []
        self.last_step: int | None = None
        self.logging_grads = False
        self._early: dict[str, Any] | None = None
        self._begin_s = 0.0

    # -- leader: requests ------------------------------------------------------------------------
    def request_join(self, rid: str) -> bool:
        assert self.is_leader, "only core rank 0 drives the pool"
        gen = self.pool.request_join(rid)
        if gen is None:
            return False
        self.t_request[rid] = time.time()
        # Counters the hybrid increments exist from the start: the per-step batched read of the pool's
        # keys then takes two store round trips instead of two per missing key.
        self.kv.set(f"ack/{rid}/{gen}", 0)
        self.kv.set(f"cmd/{rid}", {"op": "join", "gen": gen})
        self._event("join_requested", rid, gen)
        return True

    def request_release(self, rid: str) -> bool:
        assert self.is_leader, "only core rank 0 drives the pool"
        gen = self.pool.request_release(rid)
        if gen is None:
            return False
        self.t_request[rid] = time.time()
        self.kv.set(f"cmd/{rid}", {"op": "release", "gen": gen})
        self._event("release_requested", rid, gen)
        return True

    def _event(self, what: str, rid: str, gen: int, **kw: Any) -> None:
        self.events.append({"t": time.time(), "event": what, "rid": rid, "gen": gen, **kw})

    # -- leader: step boundary -------------------------------------------------------------------
    def _reports(self, h: HybridReplica, vals: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        vals = vals if vals is not None else self.kv.get_many([f"prog/{h.rid}/{k}" for k in range(h.n_ranks)])
        return [r for r in (vals.get(f"prog/{h.rid}/{k}") for k in range(h.n_ranks))
                if r is not None and r.get("gen") == h.generation]

    def _stale(self, h: HybridReplica, now: float, vals: dict[str, Any] | None = None) -> bool:
        vals = vals if vals is not None else self.kv.get_many([f"hb/{h.rid}/{k}" for k in range(h.n_ranks)])
        for k in range(h.n_ranks):
            t = vals.get(f"hb/{h.rid}/{k}")
            if t is None or now - float(t) > self.cfg.heartbeat_timeout_s:
                return True
        return False

    def _advance_pool(self, step: int) -> bool:
        """Apply the hybrids' reports; returns whether a fresh snapshot must be published now."""
        publish = False
        # One batched read of every key that matters this step: store round trips are per-step overhead.
        busy = [h for h in self.pool.hybrid.values() if not h.alive or h.state != ReplicaState.ROLLOUT]
        keys = [f"{kind}/{h.rid}/{k}" for h in busy for k in range(h.n_ranks) for kind in ("hb", "prog")]
        keys += [f"ack/{h.rid}/{h.generation}" for h in busy if h.state == ReplicaState.REQUESTED]
        keys += [f"snapreq/{h.rid}/{h.generation}" for h in busy if h.state == ReplicaState.FETCHING]
        vals = self.kv.get_many(keys)
        now = time.time()
        for h in busy:
            if not h.alive:
                # A replica declared dead comes back only if it beats again and says it serves rollout.
                reps = self._reports(h, vals)
                if reps and all(r["state"] == "rollout" for r in reps) and not self._stale(h, now, vals):
                    self.pool.revive(h.rid)
                    self._event("revived", h.rid, h.generation, step=step)
                continue
            g = h.generation
            if self._stale(h, now, vals):
                # A replica that stopped beating is dropped before it can fail a step.
                self._fail(h, step, "heartbeat lost")
                continue
            reps = self._reports(h, vals)
            states = {r["state"] for r in reps}
            full = len(reps) == h.n_ranks
            if "failed" in states and h.state != ReplicaState.ROLLOUT:
                # The replica gave up by itself (snapshot never usable, missed a commit): roll it back.
                self.pool.cancel(h.rid, g, "replica reported failure")
                self.t_request.pop(h.rid, None)
                self._event("rolled_back", h.rid, g, step=step,
                            error=[r.get("error") for r in reps if r["state"] == "failed"])
                self.kv.set(f"cmd/{h.rid}", {"op": "cancel", "gen": h.generation})
                continue
            if h.state == ReplicaState.REQUESTED and int(vals.get(f"ack/{h.rid}/{g}", 0)) >= h.n_ranks:
                self.pool.advance(h.rid, ReplicaState.FETCHING, g)
                publish = True
                # The snapshot of this step's version, then the gradient log from this step on.
                self.kv.set(f"snapreq/{h.rid}/{g}", 0)  # before `fetch/`: no refusal can precede it
                self.kv.set(f"fetch/{h.rid}/{g}", step)
                self._event("fetching", h.rid, g, step=step, ack=vals.get(f"ack/{h.rid}/{g}"))
            if h.state == ReplicaState.FETCHING and full and states <= {"loaded", "activating"}:
                # Loaded and replaying the log: it joins the domain now, sending zeros while it closes
                # the last gap to the live step.
                self.pool.advance(h.rid, ReplicaState.ZERO_SYNC, g)
                self._event("zero_sync", h.rid, g, step=step)
            if h.state == ReplicaState.ZERO_SYNC and full and states == {"activating"}:
                self.pool.advance(h.rid, ReplicaState.ACTIVATING, g)
                self._event("activating", h.rid, g, step=step)
                # Aligned replicas replay every committed step as it commits, so they hold version
                # `step` now: real gradients can start with this very step.
                self.pool.advance(h.rid, ReplicaState.TRAINING, g)
                self._event("training", h.rid, g, step=step)
            if h.state == ReplicaState.RELEASING and full and states == {"rollout"}:
                self.pool.advance(h.rid, ReplicaState.ROLLOUT, g)
                t_done = max(float(r["t"]) for r in reps)
                self.last["release_latency_s"] = t_done - self.t_request.get(h.rid, t_done)
                self._event("released", h.rid, g, step=step, latency_s=self.last["release_latency_s"])
            n_req = vals.get(f"snapreq/{h.rid}/{g}", 0)
            if h.state == ReplicaState.FETCHING and int(n_req) > self.snapreq_seen.get(h.rid, 0):
                self.snapreq_seen[h.rid] = int(n_req)
                publish = True
        return publish

    def _silent(self, plan: dict[str, Any]) -> str | None:
        """A hybrid member of the plan whose heartbeat stopped (any core rank can tell: the keys are in
        the store), so that a rendezvous with it is abandoned without waiting for the gloo timeout."""
        now = time.time()
        for rid in plan["members"]:
            h = self.pool.hybrid.get(rid)
            if h is not None and self._stale(h, now):
                return f"{rid} stopped beating"
        return None

    def _fail_dead(self, step: int, attempt: int) -> None:
        """After a failed attempt: wait for the heartbeats to tell who died; drop everyone if nobody did
        and attempts are running out (the core alone is always a valid domain)."""
        suspects = [h for h in self.pool.hybrid.values() if h.alive and h.state in IN_DOMAIN]
        deadline = time.time() + self.cfg.heartbeat_timeout_s + 4 * self.cfg.heartbeat_interval_s
        dead: list[HybridReplica] = []
        while suspects and not dead and time.time() < deadline:
            now = time.time()
            # Dead (silent), or alive but gone: it reported failure or rollout for this generation.
            dead = [h for h in suspects if self._stale(h, now)
                    or any(r["state"] in ("failed", "rollout") for r in self._reports(h))]
            if not dead:
                time.sleep(self.cfg.heartbeat_interval_s)
        if not dead and attempt + 1 >= self.cfg.max_attempts - 1:
            dead = suspects
        for h in dead:
            self._fail(h, step, f"domain failure at step {step}")

    def _fail(self, h: HybridReplica, step: int, why: str) -> None:
        g = h.generation
        self.pool.fail(h.rid, g, why)
        self.t_request.pop(h.rid, None)
        # Tell the replica (if it still lives) its new generation, so its later reports are not stale.
        self.kv.set(f"cmd/{h.rid}", {"op": "cancel", "gen": h.generation})
        self._event("failed", h.rid, g, step=step, why=why)

    def _write_plan(self, step: int, attempt: int, publish: bool) -> dict[str, Any]:
        in_dom = sorted((h for h in self.pool.hybrid.values() if h.alive and h.state in IN_DOMAIN),
                        key=lambda h: h.rid)
        members = (CORE, *(h.rid for h in in_dom if h.state == ReplicaState.TRAINING))
        joiners = [h.rid for h in in_dom if h.state != ReplicaState.TRAINING]
        if members != self.members or attempt > 0:
            self.epoch += 1  # a failed group is never reused, even with the same members
        plan = {
            "step": step, "attempt": attempt, "epoch": self.epoch, "members": list(members), "side": joiners,
            "states": {h.rid: h.state.value for h in in_dom},
            "gens": {h.rid: h.generation for h in in_dom},
            "snapshot": step if publish else None,
            "pool": {h.rid: h.state.value for h in self.pool.hybrid.values()},
            # The log serves replicas replaying from a snapshot (fetching); from zero-sync on they get each
            # step on their side channel, but may still be reading older entries: keep those until no
            # replica is catching up.
            "log_grads": any(h.alive and h.state == ReplicaState.FETCHING for h in self.pool.hybrid.values()),
            "catching_up": any(h.alive and h.state in CATCHING_UP for h in self.pool.hybrid.values()),
        }
        self.kv.set(f"plan/{step}", plan)
        self.kv.set("cur_step", step)
        return plan

    # -- every core rank -------------------------------------------------------------------------
    def _get_plan(self, step: int, min_attempt: int) -> dict[str, Any]:
        deadline = time.monotonic() + self.cfg.plan_timeout_s
        while True:
            plan = self.kv.wait(f"plan/{step}", max(0.0, deadline - time.monotonic()))
            if plan["attempt"] >= min_attempt:
                return plan
            time.sleep(0.002)

    def _all_ok(self, ok: bool) -> bool:
        if self.core_group is None or self.core_size == 1:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        # The core group is healthy by construction (its membership never changes), so it can arbitrate.
        from torch.distributed import ReduceOp
        opts_work = self.core_group.allreduce([flag], _min_opts(ReduceOp.MIN))
        opts_work.wait()
        return bool(flag.item())

    def begin_step(self, step: int) -> dict[str, Any]:
        """The plan of `step` (who is in the domain, in which state). Callers should call it before
        forward (the AReaL hook does, to split the batch among replicas; so does the test bed): then the
        snapshot clone and the rendezvous of a changed domain run beside forward/backward instead of
        after it. Otherwise reduce_gradients calls it. The state is still version `step` at either point;
        the clone is fenced before reduce_gradients returns, i.e. before the optimizer step."""
        if self._early is not None and self._early["step"] == step:
            return self._early
        t0 = time.perf_counter()
        if self.is_leader:
            plan = self._write_plan(step, 0, self._advance_pool(step))
        else:
            plan = self._get_plan(step, 0)
        if plan["snapshot"] == step:
            self.snapshots.publish_async(step, self.rank, self.state_fn(), self.corrupt.pop(0) if self.corrupt else None)
            self.published.append(step)
        if plan["epoch"] != self.domain.epoch:
            self.domain.prepare(plan["epoch"], plan["members"])
        self._early = plan
        self._begin_s = time.perf_counter() - t0
        return plan

    def reduce_gradients(self, step: int, tensors: list[torch.Tensor], weight: float) -> dict[str, float]:
        """Reduce `tensors` in place over the domain for `step`; retries with the survivors on failure.

        On the training thread only: the plan (one batched store read), waiting for the domain's
        rendezvous if it is not ready yet, the all-reduce, and handing the reduced gradient to the
        background gradient log (no copy). Inputs stay untouched until every core rank agreed to commit,
        so a retry needs no saved copy."""
        t0 = time.perf_counter()
        self.last_step = step
        attempt = 0
        plan = self.begin_step(step)
        begin_s, self._begin_s = self._begin_s, 0.0
        self._early = None
        rebuild_s = 0.0
        while True:
            ok, err = True, ""
            flat = None
            try:
                if plan["epoch"] != self.domain.epoch or self.domain.group is None:
                    self.domain.prepare(plan["epoch"], plan["members"])  # no-op when begin_step did it
                    self.domain.rebuild(plan["epoch"], plan["members"], abort=lambda p=plan: self._silent(p))
                    rebuild_s += self.domain.last_rebuild_wait_s
                if len(plan["members"]) > 1:
                    flat, _ = self.domain.reduce_flat(tensors, weight)
                # Alone in the domain the result is the core's own gradient, bit for bit: no arithmetic
                # (sum_r w_r g_r / sum_r w_r would round), so the hook is exactly inert without hybrids.
            except DomainError as e:
                ok, err = False, str(e)
            if self._all_ok(ok):
                if flat is not None:
                    GradientDomain.scatter(flat, tensors)
                if self.is_leader:
                    self.kv.set(f"result/{step}/{attempt}", "commit")
                    self._on_commit(step, plan)
                break
            self._event("step_failed", CORE, 0, step=step, attempt=attempt, error=err[:300])
            if self.is_leader:
                # New plan first, then "retry": a hybrid that reads "retry" finds the next attempt waiting.
                self._fail_dead(step, attempt)
                plan = self._write_plan(step, attempt + 1, False)
                self.kv.set(f"result/{step}/{attempt}", "retry")
            else:
                plan = self._get_plan(step, attempt + 1)
            attempt += 1
        if flat is None and (plan.get("side") or plan["log_grads"]):
            flat = torch.cat([t.reshape(-1).to(torch.float32) for t in tensors])  # one copy, for the joiners
        if plan.get("side"):
            # Zero-sync joiners get the committed gradient off the critical path (background thread).
            self.side.submit(step, [(rid, plan["gens"][rid]) for rid in plan["side"]], flat)
        if plan["log_grads"]:
            # `flat` is fresh per step (the domain's output, or the one copy above): no further copy.
            self.snapshots.publish_grad_async(step, self.rank, flat, owned=True)
            self.snapshots.gc_grads_async(self.rank)
            self.logging_grads = True
        elif self.logging_grads and not plan.get("catching_up"):
            self.snapshots.gc_grads_async(self.rank, below_oldest_snapshot=False)
            self.logging_grads = False
        t_fence = time.perf_counter()
        self.snapshots.fence()  # the optimizer step follows: the snapshot clone must have read the state
        now = time.perf_counter()
        self.last.update(reduce_s=now - t0, attempts=float(attempt + 1), begin_s=begin_s, rebuild_s=rebuild_s,
                         allreduce_s=self.domain.last_reduce_s if len(plan["members"]) > 1 else 0.0,
                         fence_s=now - t_fence)
        self.members = tuple(plan["members"])
        return self.metrics()

    def _on_commit(self, step: int, plan: dict[str, Any]) -> None:
        for rid, st in plan["states"].items():
            if st == ReplicaState.TRAINING.value and rid in self.t_request:
                # First committed step with real gradients from this replica: the join is complete.
                self.last["join_latency_s"] = time.time() - self.t_request.pop(rid)
                self._event("first_real_gradient", rid, plan["gens"][rid], step=step,
                            latency_s=self.last["join_latency_s"])

    def metrics(self) -> dict[str, float]:
        out = self.pool.metrics() if self.is_leader else {}
        out["elastic/domain_epoch"] = float(self.domain.epoch or 0)
        out["elastic/domain_size"] = float(self.domain.size)
        out["elastic/domain_rebuilds"] = float(self.domain.rebuilds)
        out["elastic/snapshots_published"] = float(len(self.published))
        out["elastic/snapshot_errors"] = float(len(self.snapshots.errors))
        out["elastic/side_sends"] = float(self.side.sent)
        out["elastic/side_errors"] = float(len(self.side.errors))
        for k, v in self.last.items():
            out[f"elastic/{k}"] = float(v)
        return out

    def shutdown(self) -> None:
        self.side.close(2.0)  # it may sit in a collective with a dead joiner until the gloo timeout: do not wait
        self.snapshots.wait(30)
        if self.is_leader:
            self.kv.set("shutdown", 1)
            if self.last_step is not None:
                # Hybrids block on the next plan: give them one that tells them to stop.
                self.kv.set(f"plan/{self.last_step + 1}", {"shutdown": True})


class _SideSender:
    """The core's end of the side channels: a background thread that, for each committed step and each
    zero-sync joiner, announces the step (`sidego/<step>/<rid>/p<pos>`, so that a joiner never sits in
    a gloo wait that could time out during a long step) and all-reduces the step's reduced gradient with
    weight 1 against the joiner's zeros: g*1 + 0 = g and /1 is exact, the joiner receives the core's bits.
    A side group is (core, joiner) for one joiner generation; a failed one is not retried (the joiner
    gives up and the leader rolls it back)."""

    def __init__(self, store: Any, position: int, cfg: RuntimeConfig, ns: str) -> None:
        self.store, self.position, self.cfg, self.ns = store, position, cfg, ns
        self.q: queue.Queue[tuple[int, list[tuple[str, int]], torch.Tensor] | None] = queue.Queue()
        self.thread: threading.Thread | None = None
        self.errors: list[str] = []
        self.sent = 0

    def submit(self, step: int, joiners: list[tuple[str, int]], flat: torch.Tensor) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name=f"side-p{self.position}", daemon=True)
            self.thread.start()
        self.q.put((step, joiners, flat))

    def _run(self) -> None:
        # Normal priority (placed off the training CPUs when configured): a joiner at the live step
        # needs one delivery per step, so starving this thread would stall the join forever on a busy
        # machine; its work per step is bounded (one copy and one send of the gradient).
        enter_background(lower=False)
        factory = _store_factory(self.store, self.cfg)
        store = factory() if factory is not None else self.store
        kv = KV(store, self.ns)
        groups: dict[str, GradientDomain] = {}
        bad: set[tuple[str, int]] = set()
        while True:
            item = self.q.get()
            if item is None:
                return
            step, joiners, flat = item
            for rid, gen in joiners:
                if (rid, gen) in bad:
                    continue  # that side channel failed (joiner died or left): never wait on it again
                dom = groups.get(rid)
                if dom is None:
                    dom = groups[rid] = GradientDomain(
                        store, position=self.position, me=CORE, timeout_s=self.cfg.domain_timeout_s,
                        chunk_elems=self.cfg.chunk_elems, backend=self.cfg.backend, namespace=f"{self.ns}side/{rid}")
                try:
                    kv.set(f"sidego/{step}/{rid}/p{self.position}", gen)
                    if dom.epoch != gen or dom.group is None:
                        dom.rebuild(gen, (CORE, rid))
                    dom.reduce_flat([flat], 1.0)
                    self.sent += 1
                except Exception as e:  # noqa: BLE001 - DomainError, or the store: this joiner only
                    bad.add((rid, gen))
                    dom.close()
                    self.errors.append(f"side channel {rid} gen {gen} step {step}: {e}")

    def close(self, timeout: float) -> None:
        if self.thread is not None:
            self.q.put(None)
            self.thread.join(timeout)


def _store_factory(store: Any, cfg: RuntimeConfig) -> Callable[[], Any] | None:
    """New client connections to the same TCPStore, for helper threads (None for other store types)."""
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    if not isinstance(store, dist.TCPStore) or host is None or port is None:
        return None
    return lambda: connect(host, port, timeout_s=max(30.0, cfg.domain_timeout_s))


def _min_opts(op: Any) -> Any:
    from torch.distributed import AllreduceOptions

    o = AllreduceOptions()
    o.reduceOp = op
    return o
