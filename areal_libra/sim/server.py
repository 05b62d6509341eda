"""One simulated rollout server: continuous batching at decode-iteration granularity.

Between two events the running batch is fixed, so the time of the next k iterations is a closed-form sum
of per-iteration times (each iteration: a + b * resident KV tokens, and the resident KV grows by the batch
size every iteration). A chunk runs until the first running request ends its segment or the KV pool
fills; an arrival interrupts the chunk at the next iteration boundary. This keeps per-iteration timing,
KV-capacity admission and preemption, without a Python loop per token.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import OrderedDict, deque

from areal_libra.cmlfq.aging import edf_insert
from areal_libra.elastic.measure import ServerLoad
from areal_libra.sim.hardware import HardwareTruth


class SimRequest:
    """A trajectory in flight (one request to the rollout fleet per segment, same object throughout)."""

    __slots__ = (
        "traj", "group", "seg", "ctx", "server", "bucket", "start_version", "t_start", "heap_seq",
        "end_it", "base", "tool_state", "migrated_tokens", "migrations", "done_tokens", "admit_order",
        "gen_seg", "gen_sum",
    )

    def __init__(self, traj, group, start_version: int, t_start: float):
        self.traj = traj
        self.group = group
        self.seg = 0
        self.ctx = traj.prompt_tokens  # context before the current segment's generation
        self.server = None
        self.bucket = 0
        self.start_version = start_version
        self.t_start = t_start
        self.heap_seq = -1
        self.end_it = 0
        self.base = 0
        self.tool_state: list = []
        self.migrated_tokens = 0
        self.migrations = 0
        self.done_tokens = 0
        self.admit_order = 0
        self.gen_seg = 0  # gen_sum = model tokens of segments[:gen_seg] (see gen_before)
        self.gen_sum = 0

    def gen_before(self) -> int:
        """Model tokens of the segments before the current one (kept incrementally: the router asks at
        every tool return, and summing the whole prefix each time was a hot path at the paper's scale)."""
        n = self.seg
        if self.gen_seg != n:
            segs = self.traj.segments
            if self.gen_seg > n:
                self.gen_seg, self.gen_sum = 0, 0
            self.gen_sum += sum(segs[i].gen_tokens for i in range(self.gen_seg, n))
            self.gen_seg = n
        return self.gen_sum

    @property
    def gen_tokens(self) -> int:
        return self.traj.segments[self.seg].gen_tokens


class RolloutServer:
    """Iteration-level model of one SGLang-like server with `tp` GPUs."""

    def __init__(self, sid: int, tp: int, bucket: int, truth: HardwareTruth, rng: random.Random,
                 mem_fraction: float | None = None, max_running: int = 512):
        self.sid = sid
        self.tp = tp
        self.bucket = bucket
        self.truth = truth
        self.rng = rng
        self.capacity = truth.kv_capacity_tokens(tp, mem_fraction)
        self.lent = False  # an Elastic Hybrid Pool worker's server: the pool may take it back any step
        if self.capacity <= 0:
            raise ValueError(f"model does not fit on a TP{tp} server (no room left for the KV cache)")
        self.max_running = max_running
        self.speed = math.exp(rng.gauss(0.0, truth.c.server_sigma))
        self.sigma = truth.c.noise_sigma
        self.it = 0
        self.clock = 0.0
        self.active: dict[SimRequest, int] = {}
        self.heap: list = []
        self.sum_base = 0
        self.queue: deque = deque()  # (req, prior_tokens, new_tokens)
        # Earliest deadline first (areal_libra.cmlfq.aging): the queue is kept ordered by the trajectories'
        # start versions, FIFO within one; off: FIFO.
        self.edf = False
        self.idle_cache: OrderedDict = OrderedDict()  # req -> cached context tokens (waiting on a tool)
        self.idle_tokens = 0
        self.chunk = None  # (t0, k, a, b, kv0, B, xi, t_end)
        self.epoch = 0
        self.busy_s = 0.0
        self.preemptions = 0
        self.prefill_tokens = 0
        self.retired = False
        self.available_at = 0.0  # not serving before this time (start-up, weight sync)
        self._seq = 0
        self._coef: dict[int, tuple[float, float]] = {}

    # ---- accounting -------------------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return len(self.active)

    def kv(self) -> int:
        return self.sum_base + len(self.active) * self.it

    def load(self) -> float:
        """Outstanding work, for least-loaded placement: running + queued requests."""
        return len(self.active) + len(self.queue)

    def server_load(self) -> ServerLoad:
        """Its counts as a live server reports them (/server_info), for the shared pressure definition."""
        return ServerLoad(running=len(self.active), waiting=len(self.queue), max_running=self.max_running,
                          kv_used=self.kv(), kv_capacity=self.capacity)

    # ---- chunk arithmetic -----------------------------------------------------------------------------
    def _coeffs(self, B: int) -> tuple[float, float]:
        c = self._coef.get(B)
        if c is None:
            c = self._coef[B] = self.truth.decode_coeffs(self.tp, B)
        return c

    @staticmethod
    def _chunk_time(k: float, a: float, b: float, kv0: float, B: int) -> float:
        return k * a + b * (k * kv0 + B * k * (k - 1) / 2.0)

    # ---- events ---------------------------------------------------------------------------------------
    def interrupt(self, t: float) -> list[SimRequest]:
        """Stop the running chunk at the first iteration boundary at or after `t`.
        Returns requests whose segment ended (only when the whole chunk had run)."""
        ch = self.chunk
        if ch is None:
            if t > self.clock:
                self.clock = t
            return []
        t0, k, a, b, kv0, B, xi, t_end = ch
        if xi is None:  # a deferred chunk (start_chunk_deferred)
            if t < t0 and a + b * kv0 - b * B / 2.0 > 0:
                # Nothing of it has run (the same j = 0 as below, exactly): it ends here, as a started chunk
                # would, after spending its noise draw (gauss consumes the generator alike whatever its
                # arguments) so that the server's later draws stay the same.
                self.rng.gauss(0.0, 1.0)
                self.clock = t0
                self.chunk = None
                self.epoch += 1
                return []
            t_end = self.materialize()[0]
            xi = self.chunk[6]
        if t >= t_end:
            return self.finish_chunk()
        # An arrival can interrupt a chunk that starts later (after a weight-sync pause): nothing has run.
        dt = (t - t0) / xi
        if not dt > 0.0:  # (max(0.0, dt) without the builtin call: this runs once per arrival)
            dt = 0.0
        # smallest j with chunk_time(j) >= dt: (bB/2) j^2 + (a + b kv0 - bB/2) j - dt = 0
        qa, qb = b * B / 2.0, a + b * kv0 - b * B / 2.0
        if qa > 0:
            j = (-qb + math.sqrt(qb * qb + 4 * qa * dt)) / (2 * qa)
        else:
            j = dt / qb
        j = math.ceil(j - 1e-9)
        if j > k:
            j = k
        if j < 0:
            j = 0
        if j >= k:
            return self.finish_chunk()
        spent = xi * self._chunk_time(j, a, b, kv0, B)
        self.it += j
        self.clock = t0 + spent
        self.busy_s += spent
        self.chunk = None
        self.epoch += 1
        return []

    def busy_at(self, t: float) -> float:
        """Busy seconds up to time `t`: busy_s credits a decode chunk when it ends or is interrupted, so a
        reading taken while one runs (the live host's, at any moment) adds the part of it before `t`."""
        ch = self.chunk
        if ch is None or ch[6] is None or t <= ch[0]:
            return self.busy_s
        return self.busy_s + min(t, ch[7]) - ch[0]

    def finish_chunk(self) -> list[SimRequest]:
        t0, k, a, b, kv0, B, xi, t_end = self.chunk
        self.it += k
        self.busy_s += t_end - t0
        self.clock = t_end
        self.chunk = None
        self.epoch += 1
        done = []
        heap = self.heap
        it = self.it
        if heap and heap[0][0] <= it:
            active = self.active
            pop = heapq.heappop
            while heap and heap[0][0] <= it:
                end_it, seq, req = pop(heap)
                if req.heap_seq != seq or req not in active:
                    continue
                self.sum_base -= active.pop(req)
                req.heap_seq = -1
                done.append(req)
        return done

    def enqueue(self, req: SimRequest, prior: int, new: int, front: bool = False) -> None:
        req.server = self
        if front:
            self.queue.appendleft((req, prior, new))
        elif self.edf:
            edf_insert(self.queue, (req, prior, new), req.start_version, _start_version)
        else:
            self.queue.append((req, prior, new))

    def park(self, req: SimRequest, tokens: int) -> None:
        """The request left the batch for a tool call; its KV stays cached (evictable)."""
        self.idle_cache[req] = tokens
        self.idle_tokens += tokens

    def relabel(self, bucket: int) -> None:
        """Serve another routing bucket from now on; the requests it holds (running, queued, cached while on a
        tool) count as placed in that bucket."""
        self.bucket = bucket
        for req in self.active:
            req.bucket = bucket
        for req, _, _ in self.queue:
            req.bucket = bucket
        for req in self.idle_cache:
            req.bucket = bucket

    def drop_cache(self, req: SimRequest) -> bool:
        tok = self.idle_cache.pop(req, None)
        if tok is None:
            return False
        self.idle_tokens -= tok
        return True

    def remove_all(self) -> list[tuple[SimRequest, int]]:
        """Take every request off this server (retirement): (request, context tokens so far)."""
        out = []
        for req, base in self.active.items():
            out.append((req, base + self.it))
            req.heap_seq = -1
        for item in self.queue:
            out.append((item[0], -1))
        self.active.clear()
        self.heap.clear()
        self.queue.clear()
        self.idle_cache.clear()
        self.idle_tokens = 0
        self.sum_base = 0
        if self.chunk is not None and self.chunk[6] is None:
            self.rng.gauss(0.0, 1.0)  # a deferred chunk's draw, as if it had started
        self.chunk = None
        self.epoch += 1
        return out

    def pause(self, t: float, duration: float, flush: bool) -> list[SimRequest]:
        """Weight update: stop at the next boundary, stay paused, optionally drop all KV (re-prefill)."""
        done = self.interrupt(t)
        self.clock = max(self.clock, t) + duration
        if flush:
            self.idle_cache.clear()
            self.idle_tokens = 0
            kv = self.kv()
            if kv > 0:
                # Running requests recompute their whole context under the new weights.
                cost = sum(self.truth.prefill_s(self.tp, base + self.it) for base in self.active.values())
                self.clock += cost * self.speed
                self.busy_s += cost * self.speed
                self.prefill_tokens += kv
        return done

    def start_chunk(self, now: float) -> tuple[float, int] | None:
        """Admit queued requests (prefill), then start decoding. Returns (end time, epoch) or None if idle."""
        if not self.start_chunk_deferred(now):
            return None
        return self.materialize()

    def materialize(self) -> tuple[float, int]:
        """Draw a deferred chunk's noise and fix its end time. Returns (end time, epoch)."""
        t0, k, a, b, kv, B, _, _ = self.chunk
        xi = self.speed * math.exp(self.rng.gauss(0.0, self.sigma / math.sqrt(k)))
        t_end = t0 + xi * (k * a + b * (k * kv + B * k * (k - 1) / 2.0))  # _chunk_time, inlined
        self.chunk = (t0, k, a, b, kv, B, xi, t_end)
        return t_end, self.epoch

    def start_chunk_deferred(self, now: float) -> bool:
        """start_chunk without the chunk's noise draw and end time (materialize() adds them; False: idle).

        At the paper's scale a step's new groups reach each server one request at a time at the same
        instant, and every arrival interrupts the chunk the previous one started before any of it ran. A
        deferred chunk that ends that way costs only its draw (interrupt); the Simulation materializes
        the chunks still running before it takes its next event. Same chunks, draws and results."""
        if self.chunk is not None:
            raise RuntimeError("start_chunk while a chunk runs")
        # The hot path of paper-scale runs (one call per chunk): attributes read once into locals, the
        # same arithmetic in the same order as before (results are byte-identical).
        clock = self.clock
        if now > clock:
            clock = now
        if self.available_at > clock:
            clock = self.available_at
        self.clock = clock
        cap = self.capacity
        active = self.active
        it = self.it
        kv = self.sum_base + len(active) * it
        q = self.queue
        if q:
            prefill = 0.0
            idle_cache = self.idle_cache
            max_running = self.max_running
            heap = self.heap
            push = heapq.heappush
            prefill_s = self.truth.prefill_s
            tp = self.tp
            # Integer counters kept in locals through the loop and stored back after it.
            idle_tokens, prefill_tokens, sum_base, seq = self.idle_tokens, self.prefill_tokens, self.sum_base, self._seq
            while q and len(active) < max_running:
                req, prior, new = q[0]
                cached = req in idle_cache
                need = prior + new
                if cached:
                    idle_tokens -= idle_cache.pop(req)
                while kv + idle_tokens + need > cap and idle_cache:
                    _, tok = idle_cache.popitem(last=False)  # evict least recently parked
                    idle_tokens -= tok
                if kv + need > cap and active:
                    if cached:
                        idle_cache[req] = prior
                        idle_tokens += prior
                    break
                q.popleft()
                if cached:
                    prefill += prefill_s(tp, new, prior)
                    prefill_tokens += new
                else:
                    prefill += prefill_s(tp, need, 0)
                    prefill_tokens += need
                base = need - it
                active[req] = base
                sum_base += base
                seq += 1
                req.heap_seq = seq
                req.admit_order = seq
                left = req.traj.segments[req.seg].gen_tokens - req.done_tokens
                req.end_it = end_it = it + (left if left > 1 else 1)
                push(heap, (end_it, seq, req))
                kv += need
            self.idle_tokens, self.prefill_tokens, self.sum_base, self._seq = idle_tokens, prefill_tokens, sum_base, seq
            if prefill > 0:
                spent = prefill * self.speed
                self.clock += spent
                self.busy_s += spent
        B = len(active)
        if B == 0:
            return False
        k = self.heap[0][0] - it
        room = (cap - kv) // B
        while room < 1 and len(active) > 1:
            self._preempt()
            kv = self.kv()
            B = len(active)
            room = (cap - kv) // B
            k = self.heap[0][0] - it
        k = max(1, min(k, room)) if room >= 1 else max(1, k)
        c = self._coef.get(B)  # _coeffs(B), inlined
        if c is None:
            c = self._coef[B] = self.truth.decode_coeffs(self.tp, B)
        self.chunk = (self.clock, k, c[0], c[1], kv, B, None, None)
        self.epoch += 1
        return True

    def _preempt(self) -> None:
        """KV pool full: retract the most recently admitted request; it re-prefills its context later."""
        # `active` is filled in admission order (admit_order increases), so its last key is the newest.
        victim = next(reversed(self.active))
        base = self.active.pop(victim)
        self.sum_base -= base
        ctx = base + self.it
        victim.done_tokens += ctx - (victim.ctx + victim.done_tokens)
        victim.heap_seq = -1
        self.preemptions += 1
        if self.edf:
            edf_insert(self.queue, (victim, 0, ctx), victim.start_version, _start_version)
        else:
            self.queue.appendleft((victim, 0, ctx))


def _start_version(item: tuple) -> int:
    return item[0].start_version
