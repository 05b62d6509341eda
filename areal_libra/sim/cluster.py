"""Discrete-event simulation of asynchronous (or synchronous) agentic RL on a GPU cluster.

Rollout servers (areal_libra/sim/server.py) generate trajectories at iteration level; tool calls take
their latency outside the batch; a trainer consumes GRPO groups in batches under AReaL's staleness rule
(a group may start only while started <= (version + max_staleness + 1) * batch, and a step must include
every unconsumed group that would otherwise exceed the bound); each step ends with a weight sync that
pauses the rollout servers. A controller (areal_libra/sim/systems.py) sees only what a live system sees —
finished trajectories and measured times — and may re-plan, reconfigure or move elastic replicas.
"""

from __future__ import annotations

import gc
import heapq
import math
import random
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from areal_libra.cmlfq.aging import admit_group, select_batch
from areal_libra.elastic.measure import pressure, rollout_busy_share, rollout_time
from areal_libra.sim.hardware import HardwareTruth
from areal_libra.sim.server import RolloutServer, SimRequest
from areal_libra.sim.workloads import Workload

CHUNK, TOOL, TRAIN_END, TRAIN_TRY, CALL = range(5)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector (reference counting still frees everything). A paper-scale
    run allocates millions of short-lived objects while holding hundreds of thousands of long-lived ones
    (trajectories, requests), so the collector kept re-scanning the live heap: 15-25% of the CPU time, for
    almost no cyclic garbage (a few hundred objects a run). Results do not depend on it."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def workload_rng(seed: int) -> random.Random:
    """The generator a Simulation of `seed` draws its workload's groups with (and nothing else)."""
    return random.Random(seed * 7919 + 1)


def train_noise_rng(seed: int) -> random.Random:
    """The generator of a Simulation's training-step noise, and nothing else: common random numbers across
    the systems compared on one seed. Drawn from the stream the servers' generators come from, every server a
    system added (a reconfiguration, a hybrid worker lent for the fill) shifted the noise of every later
    training step: +elastic and +cmlfq on the same plan differed by 1.6% with no elastic move."""
    return random.Random(seed * 104729 + 17)


class SimError(ValueError):
    """Configuration the simulated cluster cannot run (e.g. no room for a model replica)."""


@dataclass(frozen=True)
class TrainLayout:
    tp: int
    pp: int
    dp: int
    # Sequences per micro-batch as the job was configured (Megatron's micro_batch_size); 0 = the trainer's
    # own default (see HardwareTruth.train_step_s).
    micro_batch: int = 0

    def micro_batches(self, n_seqs: int) -> int | None:
        """Micro-batches per DP rank for a step of `n_seqs` sequences, or None for the trainer's default."""
        if self.micro_batch <= 0:
            return None
        return max(1, n_seqs // (self.dp * self.micro_batch))

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass
class Layout:
    """Where every GPU works: the training topology and the rollout servers (TP, bucket) in order."""

    train: TrainLayout
    servers: list[tuple[int, int]]  # (tp, bucket index)
    bucket_limits: list[int] = field(default_factory=lambda: [1 << 30])  # max final length per bucket

    @property
    def rollout_gpus(self) -> int:
        return sum(tp for tp, _ in self.servers)


@dataclass
class RunConfig:
    max_staleness: int = 4  # AReaL max_head_offpolicyness; 0 = synchronous
    colocated: bool = False  # verl hybrid engine: rollout and training time-share all GPUs
    mem_fraction: float | None = None  # KV pool fraction (colocated engines keep less)
    flush_kv_on_sync: bool = True
    tool_latency_scale: float = 1.0
    train_noise: bool = True
    reconfig_train_s: float = 60.0  # re-shard the training job after a topology change
    max_running: int = 256
    strict_staleness: bool = False  # also bound each consumed group's staleness (waits for stragglers)
    # Servers admit waiting requests oldest start version first (areal_libra.cmlfq.aging); False: FIFO.
    edf: bool = False
    # AReaL's rollout.max_concurrent_rollouts: episodes (GRPO groups) running at once. 0: only the staleness
    # bound (the emulated experiment sets 8192); None: AReaL's own default, the consumer batch
    # (areal/infra/workflow_executor.py). evaluation.throughput --max-concurrent-rollouts.
    max_concurrent_groups: int | None = 0
    # Libra's working-set admission (cmlfq.aging.admit_group): no new group starts while the contexts of the
    # running trajectories fill the rollout servers' KV; a finished trajectory looks again.
    working_set_admission: bool = False


class Router:
    """Placement policy interface used by the simulation (adapters wrap the scheduler's policies)."""

    n_buckets = 1

    def start(self, req: SimRequest) -> int:
        return 0

    def tool_return(self, req: SimRequest) -> int:
        return req.bucket

    def finish(self, req: SimRequest) -> None:
        pass

    def displaced(self, req: SimRequest) -> int:
        """The bucket for a request whose server was taken away (its context re-prefills elsewhere)."""
        return req.bucket


class Controller:
    """Hook called after every training step; may change the layout. Base: static."""

    def on_step_end(self, sim: Simulation, rec: dict) -> None:
        pass

    def before_train(self, sim: Simulation) -> float:
        """Called when the trainer has a batch, before it starts the step; returns seconds the trainer must
        still wait (replicas joining it). Base: none."""
        return 0.0


@dataclass
class Group:
    gid: int
    version: int
    n_left: int
    trajs: list
    t_start: float
    ready: bool = False
    t_ready: float = 0.0


class Simulation:
    # Chunks started while many requests arrive at one instant (_admit, retire_server) are deferred (_kick);
    # False starts each at once, as before (the tests compare both).
    defer_arrivals = True

    def __init__(self, truth: HardwareTruth, workload: Workload, n_gpus: int, layout: Layout,
                 run: RunConfig | None = None, router: Router | None = None,
                 controller: Controller | None = None, seed: int = 0):
        self.truth = truth
        self.workload = workload
        self.n_gpus = n_gpus
        self.cfg = run or RunConfig()
        self.router = router or Router()
        self.set_router(self.router)
        self.controller = controller or Controller()
        self.rng = random.Random(seed)  # the servers' own generators are drawn from it
        self.wl_rng = workload_rng(seed)
        self.train_rng = train_noise_rng(seed)
        self.batch = workload.cfg.batch_prompts
        self.t = 0.0
        self.events: list = []
        self._deferred: list = []  # (server, sequence number, epoch) of deferred chunks (_kick, _flush)
        self._defer = False  # _kick defers the chunks it starts (while placing many requests at one instant)
        self._seq = 0
        self.servers: list[RolloutServer] = []
        self._sid = 0
        self.version = 0
        self.started_groups = 0
        self.in_flight = 0  # trajectories started and not finished (bounded by the truth's max_in_flight)
        self.working_tokens = 0  # context tokens of the running trajectories (RunConfig.working_set_admission)
        self._gated = False  # working-set admission held a group back; the next finished trajectory admits
        self.groups_running = 0  # groups started and not finished (bounded by RunConfig.max_concurrent_groups)
        mc = self.cfg.max_concurrent_groups
        self.max_groups = self.batch if mc is None else mc
        self.max_groups_running = 0
        self.pending: deque[Group] = deque()  # started, not yet consumed, in start order
        self.train_layout = layout.train
        self.layout = layout
        self.trainer_busy = False
        self.trainer_available_at = 0.0
        self.train_busy_s = 0.0
        self.train_gpu_s = 0.0
        self.records: list[dict] = []
        self.trained: list = []  # every trajectory a training step consumed (the roofline's work)
        # (prompt_tokens, final_length, model_tokens) of finished trajectories: what the live system records
        self.finished: deque = deque(maxlen=4000)
        self.finished_trajs: deque = deque(maxlen=4000)
        self.reconfigurations = 0
        self.elastic_moves = 0  # elastic pool joins/releases carried out (each moves >= 1 replica)
        self.staleness_seen: list[int] = []
        self.gen_tokens = 0
        self.migrated_tokens = 0
        self.route_decisions = 0  # routing decisions of C-MLFQ (starts + tool returns) ...
        self.fallback_decisions = 0  # ... of which its least-loaded fallback made
        self.total_final = 0
        self.traj_durations: list[float] = []
        self.traj_versions: list[int] = []
        self._retired_busy = 0.0
        self._retired_gpu_s = 0.0
        self._last_step_t = 0.0
        self._trainer_ready_t = 0.0
        self.max_lead = 0
        self._blocked_on = ""
        self._last_busy = 0.0
        self._gpu_time_origin: dict[int, float] = {}
        self._check_layout(layout)
        for tp, b in layout.servers:
            self._add_server(tp, b, 0.0)

    # ---------------- layout ----------------
    def _check_layout(self, layout: Layout) -> None:
        if self.truth.kv_capacity_tokens(1 if not layout.servers else min(tp for tp, _ in layout.servers),
                                         self.cfg.mem_fraction) <= 0:
            raise SimError("a rollout server of this layout cannot hold the model plus any KV cache")
        used = layout.train.gpus + (0 if self.cfg.colocated else layout.rollout_gpus)
        if used > self.n_gpus:
            raise SimError(f"layout needs {used} GPUs but the cluster has {self.n_gpus}")
        if not layout.servers:
            raise SimError("layout has no rollout server")

    def _add_server(self, tp: int, bucket: int, available_at: float, lent: bool = False) -> RolloutServer:
        s = RolloutServer(self._sid, tp, bucket, self.truth, random.Random(self.rng.random()),
                          self.cfg.mem_fraction, self.cfg.max_running)
        self._sid += 1
        s.available_at = available_at
        s.clock = available_at
        s.edf = self.cfg.edf
        s.lent = lent
        self._gpu_time_origin[s.sid] = self.t
        self.servers.append(s)
        return s

    def retire_server(self, s: RolloutServer) -> None:
        """Take a server away (its GPUs move elsewhere); its requests re-prefill on other servers."""
        done = s.interrupt(self.t)
        self._handle_done(s, done)
        s.retired = True
        self.servers.remove(s)
        self._retired_busy += s.busy_s * s.tp
        self._retired_gpu_s += (self.t - self._gpu_time_origin.pop(s.sid)) * s.tp
        defer, self._defer = self._defer, self.defer_arrivals
        for req, ctx in s.remove_all():
            if ctx >= 0:  # was decoding: keep what it generated
                req.done_tokens = ctx - req.ctx
            req.migrations += 1
            full = req.ctx + req.done_tokens
            req.migrated_tokens += full
            self.migrated_tokens += full
            self._place(req, self.router.displaced(req), prior=0, new=full)
        self._defer = defer
        self._flush()

    def apply_layout(self, layout: Layout, train_changed: bool, start_delay: float | None = None) -> None:
        """Reconfigure to `layout`: keep matching servers, retire the rest, start the new ones. A server is kept
        for any spec of its TP, as the live fleet keeps every server whose kind the new layout still needs: one in
        the same bucket first, else it moves to another bucket of its TP with what it holds (a bucket is the
        router's, not the server's). The pool's servers (lent) only keep their own bucket."""
        self._check_layout(layout)
        want: dict[tuple[int, int], int] = {}
        for spec in layout.servers:
            want[spec] = want.get(spec, 0) + 1
        keep = []
        for s in list(self.servers):
            key = (s.tp, s.bucket)
            if want.get(key, 0) > 0:
                want[key] -= 1
                keep.append(s)
        for s in self.servers:
            if s in keep or s.lent:
                continue
            key = next((k for k, n in sorted(want.items()) if k[0] == s.tp and n > 0), None)
            if key is not None:
                want[key] -= 1
                s.relabel(key[1])
                keep.append(s)
        for s in keep:
            s.lent = False  # a server of the new layout's core
        self.layout = layout
        new = []
        for (tp, b), n in want.items():
            for _ in range(n):
                delay = self.truth.server_start_s(tp) if start_delay is None else start_delay
                new.append(self._add_server(tp, b, self.t + delay))
        for s in [s for s in self.servers if s not in keep and s not in new]:
            self.retire_server(s)
        if train_changed or layout.train != self.train_layout:
            self.train_layout = layout.train
            self.trainer_available_at = max(self.trainer_available_at, self.t + self.cfg.reconfig_train_s)
            self._push(self.trainer_available_at, TRAIN_TRY, None)
        self.reconfigurations += 1

    def set_train_dp(self, dp: int, available_at: float | None = None) -> None:
        """Elastic join/release of whole data-parallel replicas (core TP/PP untouched)."""
        lay = self.train_layout
        self.train_layout = TrainLayout(lay.tp, lay.pp, dp, lay.micro_batch)
        self.layout = Layout(self.train_layout, self.layout.servers, self.layout.bucket_limits)
        if available_at is not None:
            self.trainer_available_at = max(self.trainer_available_at, available_at)
            self._push(self.trainer_available_at, TRAIN_TRY, None)

    # ---------------- event plumbing ----------------
    def set_router(self, router: Router) -> None:
        self.router = router
        bind = getattr(router, "bind", None)
        if bind is not None:
            bind(self)

    def _push(self, t: float, kind: int, obj, epoch: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, kind, obj, epoch))

    def call_at(self, t: float, fn) -> None:
        self._push(t, CALL, fn)

    def _kick(self, s: RolloutServer) -> None:
        if s.retired:
            return
        if s.chunk is not None:
            done = s.interrupt(self.t)
            if done:
                self._handle_done(s, done)
        if s.chunk is None and not s.retired and s.start_chunk_deferred(self.t):
            self._seq += 1  # _push, inlined (once per arrival and tool return)
            if self._defer:
                # Many arrivals at this instant (_admit, retire_server): the chunk's event keeps its place in
                # the order (its sequence number) and enters the queue when _flush materializes the chunk,
                # unless the next arrival on this server ends it first (RolloutServer.start_chunk_deferred).
                self._deferred.append((s, self._seq, s.epoch))
            else:
                t_end, epoch = s.materialize()
                heapq.heappush(self.events, (t_end, self._seq, CHUNK, s, epoch))

    def _flush(self) -> None:
        """Materialize the deferred chunks still running and queue their end events."""
        ev = self.events
        for s, seq, epoch in self._deferred:
            if s.epoch == epoch and not s.retired:
                t_end, _ = s.materialize()
                heapq.heappush(ev, (t_end, seq, CHUNK, s, epoch))
        self._deferred.clear()

    def _pick_server(self, bucket: int) -> RolloutServer:
        """Least loaded per GPU (then lowest id) among the bucket's servers (the highest bucket's when the
        bucket is past it; every server when none is in it)."""
        servers = self.servers
        top = max(s.bucket for s in servers)
        if bucket > top:
            bucket = top
        # min(key=(load() / tp, sid)) as a plain loop (once per placement): RolloutServer.load() inlined.
        best, bx, bsid = None, 0.0, 0
        for s in servers:
            if s.bucket == bucket:
                x = (len(s.active) + len(s.queue)) / s.tp
                if best is None or x < bx or (x == bx and s.sid < bsid):
                    best, bx, bsid = s, x, s.sid
        if best is None:
            return min(servers, key=lambda s: (s.load() / s.tp, s.sid))
        return best

    def _place(self, req: SimRequest, bucket: int, prior: int, new: int, server: RolloutServer | None = None) -> None:
        s = server or self._pick_server(bucket)
        req.bucket = s.bucket
        s.enqueue(req, prior, new)
        self._kick(s)

    # ---------------- trajectories ----------------
    def _admit(self) -> None:
        cap = (self.version + self.cfg.max_staleness + 1) * self.batch
        limit = self.truth.c.max_in_flight
        defer, self._defer = self._defer, self.defer_arrivals
        try:
            self._admit_groups(cap, limit)
        finally:
            self._defer = defer
        self._flush()

    def _admit_groups(self, cap: int, limit: int) -> None:
        gate = self.cfg.working_set_admission
        kv_cap = sum(s.capacity for s in self.servers if not s.lent) if gate else 0
        while self.started_groups < cap:
            if gate and not admit_group(self.working_tokens, kv_cap):
                self._gated = True  # _traj_done admits again
                break
            if limit and self.in_flight >= limit:
                break  # the environment runs no more trajectories at once; _traj_done admits again
            if self.max_groups and self.groups_running >= self.max_groups:
                break  # AReaL's concurrency cap; a finished group admits again (_traj_done)
            self.groups_running += 1
            if self.groups_running > self.max_groups_running:
                self.max_groups_running = self.groups_running
            trajs = self.workload.sample_group(self.version, self.wl_rng)
            self.in_flight += len(trajs)
            g = Group(self.started_groups, self.version, len(trajs), trajs, self.t)
            self.started_groups += 1
            # How many batches rollout runs ahead of training: AReaL's bound is lead <= max_staleness.
            self.max_lead = max(self.max_lead, -(-self.started_groups // self.batch) - self.version - 1)
            self.pending.append(g)
            for tr in trajs:
                self.working_tokens += tr.prompt_tokens
                req = SimRequest(tr, g, self.version, self.t)
                b = self.router.start(req)
                self._place(req, b, prior=0, new=tr.prompt_tokens)

    def _handle_done(self, s: RolloutServer, done: list[SimRequest]) -> None:
        t = s.clock
        scale, truth_scale = self.cfg.tool_latency_scale, self.truth.c.tool_latency_scale
        for req in done:
            seg = req.traj.segments[req.seg]
            gen = seg.gen_tokens
            self.gen_tokens += gen
            self.working_tokens += gen
            req.done_tokens = 0
            after_gen = req.ctx + gen
            tool = seg.tool
            if tool is not None:
                s.park(req, after_gen)
                req.ctx = after_gen
                self._seq += 1  # _push, inlined
                heapq.heappush(self.events, (t + tool.latency_s * scale * truth_scale, self._seq, TOOL, req, 0))
            else:
                self.working_tokens -= after_gen
                self._traj_done(req, t)

    def _traj_done(self, req: SimRequest, t: float) -> None:
        tr = req.traj
        self.router.finish(req)
        self.in_flight -= 1
        if self.truth.c.max_in_flight or self._gated:
            self._gated = False
            self.call_at(t, self._admit)  # a slot freed; admit after this event, not inside a server's update
        final = tr.final_length
        self.finished.append((tr.prompt_tokens, final, tr.model_tokens))
        self.finished_trajs.append(tr)
        self.total_final += final
        self.traj_durations.append(t - req.t_start)
        self.traj_versions.append(req.start_version)
        g = req.group
        g.n_left -= 1
        if g.n_left == 0:
            self.groups_running -= 1
            if self.max_groups and not self.truth.c.max_in_flight:
                self.call_at(t, self._admit)
            g.ready = True
            g.t_ready = t
            self._try_train()

    def _tool_return(self, req: SimRequest) -> None:
        seg = req.traj.segments[req.seg]
        payload = seg.tool.payload_tokens
        self.working_tokens += payload
        req.tool_state.append(seg.tool)
        req.seg += 1
        old = req.server
        b = self.router.tool_return(req)
        if b == req.bucket and old is not None and not old.retired:
            # _place(req, b, prior=context before the payload, new=payload, server=old), inlined
            prior = req.ctx
            req.ctx = prior + payload
            req.bucket = old.bucket
            old.enqueue(req, prior, payload)  # FIFO, or oldest start version first (RunConfig.edf)
            self._kick(old)
            return
        if old is not None:
            old.drop_cache(req)
        if b != req.bucket:
            req.migrations += 1
        req.migrated_tokens += req.ctx
        self.migrated_tokens += req.ctx
        req.ctx += payload
        self._place(req, b, prior=0, new=req.ctx)

    # ---------------- training ----------------
    def _try_train(self) -> None:
        if self.trainer_busy or self.t < self.trainer_available_at - 1e-9:
            return
        k = self.version
        # AReaL (default): groups are consumed oldest-first among the finished ones; the bound acts at
        # admission, so a straggler is used later rather than waited for. Strict mode also guarantees
        # every consumed group started at most max_staleness versions ago, by waiting for stragglers
        # (cmlfq.aging.select_batch, the live executor's rule too).
        eta = self.cfg.max_staleness if self.cfg.strict_staleness else None
        batch, why = select_batch(((g, g.version, g.ready) for g in self.pending), k, eta, self.batch)
        if batch is None:
            self._blocked_on = why
            return
        hold = self.controller.before_train(self)
        if hold > 0:
            self.trainer_available_at = self.t + hold
            self._push(self.trainer_available_at, TRAIN_TRY, None)
            return
        chosen = set(id(g) for g in batch)
        self.trained.extend(tr for g in batch for tr in g.trajs)
        self.pending = deque(g for g in self.pending if id(g) not in chosen)
        lens = [tr.final_length for g in batch for tr in g.trajs]
        lay = self.train_layout
        dur = self.truth.train_step_s(lens, lay.tp, lay.pp, lay.dp, lay.micro_batches(len(lens)))
        if self.cfg.train_noise:
            dur *= math.exp(self.train_rng.gauss(0.0, self.truth.c.train_noise_sigma))
        if self.cfg.colocated:
            dur += self.truth.reshard_s(self.n_gpus)
        self.trainer_busy = True
        self.train_busy_s += dur
        self.train_gpu_s += dur * lay.gpus
        stale = [k - g.version for g in batch]
        self.staleness_seen.extend(stale)
        # What the trainer measures before the step: how long it sat ready without a full batch (rollout
        # too slow), and how many finished groups were already waiting beyond this batch (rollout ahead).
        wait = max(0.0, self.t - max(self._trainer_ready_t, self.trainer_available_at))
        backlog = sum(1 for g in self.pending if g.ready)
        waited_for = self._blocked_on if wait > 0 else ""
        self._blocked_on = ""
        info = {"groups": batch, "train_s": dur, "t_start": self.t, "max_staleness": max(stale),
                "wait_s": wait, "backlog": backlog, "waited_for": waited_for,
                "tokens": sum(tr.model_tokens for g in batch for tr in g.trajs),
                "prompt_tokens": sum(tr.prompt_tokens for g in batch for tr in g.trajs),
                "final_tokens": sum(lens), "train_gpus": lay.gpus}
        self._push(self.t + dur, TRAIN_END, info)

    def _train_end(self, info: dict) -> None:
        self.version += 1
        self.trainer_busy = False
        if self.cfg.colocated:
            sync = self.truth.reshard_s(self.n_gpus)
        else:
            sync = self.truth.weight_sync_s(len(self.servers))
        # The trainer is busy with the weight update until the sync ends; set before the servers pause, since a
        # group that a pause completes tries to start the next step (it started at once, with no sync, and
        # its "wait" counted from the previous step's start: a spurious rollout-bound step).
        self.trainer_available_at = max(self.trainer_available_at, self.t + sync)
        self._trainer_ready_t = self.trainer_available_at
        for s in list(self.servers):
            done = s.pause(self.t, sync, self.cfg.flush_kv_on_sync)
            if done:
                self._handle_done(s, done)
            if s.chunk is None:
                r = s.start_chunk(s.clock)
                if r is not None:
                    self._push(r[0], CHUNK, s, r[1])
        busy = self._busy_total()
        interval = max(1e-9, self.t - self._last_step_t)
        roll_gpus = sum(s.tp for s in self.servers)
        p = pressure(s.server_load() for s in self.servers)
        rec = {
            "step": self.version - 1, "t_end": self.t, "interval_s": interval, "train_s": info["train_s"],
            "tokens": info["tokens"], "prompt_tokens": info["prompt_tokens"], "final_tokens": info["final_tokens"],
            "max_staleness": info["max_staleness"],
            "train_gpus": info["train_gpus"], "rollout_gpus": roll_gpus,
            "rollout_busy_frac": rollout_busy_share(busy - self._last_busy, interval, roll_gpus),
            # the live sampler's definition (elastic.measure.pressure), at the step's end
            "queue_pressure": p.queue, "active_pressure": p.active,
            "queued": sum(len(s.queue) for s in self.servers),
            "running": sum(s.batch for s in self.servers),
        }
        # T_rollout as a live trainer can measure it: the time one batch took to arrive. If the trainer
        # waited for enough finished groups, that is train + wait; otherwise (it did not wait, or it waited
        # only for a straggler the staleness bound forces into this batch) rollout is ahead by the share of
        # groups already waiting beyond this batch.
        rec["wait_s"], rec["backlog"], rec["waited_for"] = info["wait_s"], info["backlog"], info["waited_for"]
        rec["t_rollout_s"] = rollout_time(info["train_s"], info["wait_s"], info["backlog"], self.batch,
                                          waited_for_count=info["waited_for"] == "count")
        self._last_step_t, self._last_busy = self.t, busy
        self.records.append(rec)
        end_step = getattr(self.router, "end_step", None)
        if end_step is not None:
            end_step()  # C-MLFQ inserts the step's finished trajectories into its prefix tree
        self.controller.on_step_end(self, rec)
        self._admit()
        self._push(self.trainer_available_at, TRAIN_TRY, None)

    def _busy_total(self) -> float:
        return self._retired_busy + sum(s.busy_s * s.tp for s in self.servers)

    # ---------------- main loop ----------------
    def run(self, steps: int, wall_limit_s: float | None = None) -> dict:
        if steps < 1:
            raise SimError("steps must be >= 1")
        with gc_paused():
            return self._run(steps)

    def _run(self, steps: int) -> dict:
        self._admit()
        ev = self.events
        deferred = self._deferred
        while self.version < steps:
            if deferred:
                self._flush()
            if not ev:
                break
            t, _, kind, obj, epoch = heapq.heappop(ev)
            if kind == CHUNK:
                if obj.epoch != epoch or obj.retired:
                    continue
                self.t = t
                done = obj.finish_chunk()
                self._handle_done(obj, done)
                if obj.chunk is None and not obj.retired:
                    r = obj.start_chunk(t)
                    if r is not None:
                        self._seq += 1  # _push, inlined
                        heapq.heappush(ev, (r[0], self._seq, CHUNK, obj, r[1]))
            elif kind == TOOL:
                self.t = t
                self._tool_return(obj)
            elif kind == TRAIN_END:
                self.t = t
                self._train_end(obj)
            elif kind == TRAIN_TRY:
                self.t = max(self.t, t)
                self._try_train()
            else:
                self.t = t
                obj()
        if self.version < steps:
            raise SimError(f"simulation stalled at step {self.version} (no events left)")
        return self.summary()

    def summary(self) -> dict:
        wall = self.records[-1]["t_end"] if self.records else self.t
        toks = sum(r["tokens"] for r in self.records)
        roll_gpu_s = self._retired_gpu_s + sum((self.t - self._gpu_time_origin[s.sid]) * s.tp for s in self.servers)
        if self.cfg.colocated:
            roll_gpu_s = wall * self.n_gpus
        return {
            "tokens_per_s": toks / wall if wall > 0 else 0.0,
            "mean_step_s": wall / max(1, len(self.records)),
            "rollout_busy_frac": min(1.0, self._busy_total() / max(1e-9, roll_gpu_s)),
            "train_busy_frac": min(1.0, self.train_gpu_s / max(1e-9, wall * (self.n_gpus if self.cfg.colocated
                                                                                else self._mean_train_gpus()))),
            "reconfigurations": self.reconfigurations,
            "elastic_moves": self.elastic_moves,
            "steps": len(self.records),
            "wall_s": wall,
            "max_staleness": max(self.staleness_seen) if self.staleness_seen else 0,
            "max_lead": self.max_lead,
            "migrated_token_ratio": self.migrated_tokens / max(1, self.total_final),
            # Share of C-MLFQ's routing decisions its least-loaded fallback made (None: no C-MLFQ routing).
            "fallback_fraction": self.fallback_decisions / self.route_decisions if self.route_decisions else None,
            "preemptions": sum(s.preemptions for s in self.servers),
        }

    def _mean_train_gpus(self) -> float:
        if not self.records:
            return float(self.train_layout.gpus)
        return sum(r["train_gpus"] * r["interval_s"] for r in self.records) / max(
            1e-9, sum(r["interval_s"] for r in self.records))
