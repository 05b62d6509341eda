"""Rollout cost model: one inference server of tensor-parallel degree tp (SGLang-style continuous batching).

Decode is memory-bandwidth bound at small batch and compute bound at large batch:
    step = max((weights read + KV read) / (tp * HBM bw * hbm_eff),  FLOPs / (tp * peak * decode_mfu))
           + per-layer all-reduces (2 per layer, tp > 1) + a fixed per-step overhead.
Weights are divided by tp exactly once (the public Libra code divides twice). KV capacity is
(tp * HBM - tp * workspace - weights) / KV bytes per token, where a KV head is replicated, not split, once
tp exceeds the model's KV heads — the public code overstates this capacity by a factor tp.

Array-friendly: the decode/prefill/group formulas accept numpy arrays, so the planner's DP evaluates
thousands of (tp, interval, instances) cases in one call.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from areal_libra.cost.presets import HardwareSpec, ModelSpec


def allreduce_s(hw: HardwareSpec, nbytes, group: int, span: int | None = None):
    """Ring all-reduce of `nbytes` over `group` ranks: 2(g-1)/g of the data crosses each link."""
    if group <= 1:
        return 0.0 * nbytes
    bw = hw.link_bw(group, span if span is not None else group)
    return hw.comm_latency_s + 2.0 * (group - 1) / group * nbytes / bw


@dataclass
class RolloutCost:
    hw: HardwareSpec
    model: ModelSpec
    tp: int
    max_running: int = 256  # SGLang max_running_requests per server

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        m = self.model
        # A KV head cannot be split: beyond n_kv_heads ranks, heads are replicated.
        self._kv_shards = min(self.tp, m.n_kv_heads)
        self._kv_bytes_gpu = m.kv_bytes_per_token / self._kv_shards  # per token, per GPU
        self._dense_bytes = m.dense_params * m.dtype_bytes
        self._expert_bytes = m.expert_params * m.dtype_bytes

    # ---------------------------------------------------------------- memory
    def kv_capacity_tokens(self) -> int:
        """Tokens of KV cache one server holds: (tp*HBM - tp*workspace - weights) / per-token KV bytes, where
        the per-token bytes count replicated KV heads when tp > n_kv_heads. <= 0 means the model does not fit."""
        free = self.tp * (self.hw.hbm_bytes - self.hw.workspace_bytes) - self.model.weight_bytes
        per_token_total = self._kv_bytes_gpu * self.tp
        return int(free // per_token_total) if free > 0 else 0

    def fits(self) -> bool:
        return self.kv_capacity_tokens() > 0

    # ---------------------------------------------------------------- time
    def _weight_read_bytes(self, batch):
        """Bytes of weights one decode step streams from HBM (all GPUs together). For MoE only the experts
        the batch routes to are read: expected touched fraction 1 - (1 - k/E)^batch."""
        if not self.model.is_moe:
            return self._dense_bytes + 0.0 * batch
        m = self.model
        frac = 1.0 - np.power(1.0 - m.experts_per_token / m.n_experts, np.maximum(batch, 1.0))
        return self._dense_bytes + self._expert_bytes * frac

    def _comm_s(self, tokens):
        """Two all-reduces of the hidden states per layer (attention out, MLP out) for tp > 1."""
        if self.tp <= 1:
            return 0.0 * tokens
        nbytes = tokens * self.model.hidden * self.model.dtype_bytes
        return 2 * self.model.n_layers * allreduce_s(self.hw, nbytes, self.tp)

    def decode_parts(self, batch, kv_tokens):
        """(memory time, compute time) of one decode iteration: HBM traffic and FLOPs at their efficiencies."""
        hw, m, tp = self.hw, self.model, self.tp
        mem = (self._weight_read_bytes(batch) / tp + kv_tokens * self._kv_bytes_gpu) / (hw.hbm_bw * hw.hbm_eff)
        flops = 2.0 * m.active_params * batch + 4.0 * m.n_layers * m.attn_dim * kv_tokens
        return mem, flops / (tp * hw.flops * hw.decode_mfu)

    def decode_step_s(self, batch, kv_tokens):
        """One decode iteration for `batch` running requests holding `kv_tokens` tokens of KV in total."""
        mem, comp = self.decode_parts(batch, kv_tokens)
        hw = self.hw
        return np.maximum(mem, comp) + self._comm_s(batch) + self.step_overhead_s() + hw.seq_overhead_s * batch

    def step_overhead_s(self) -> float:
        """Fixed time of one decode step: the per-step term plus the per-layer term for every layer."""
        return self.hw.step_overhead_s + self.model.n_layers * self.hw.decode_layer_overhead_s

    def call_overhead_s(self) -> float:
        """Fixed time of one prefill call: the per-call term plus the per-layer term for every layer."""
        return self.hw.prefill_overhead_s + self.model.n_layers * self.hw.prefill_layer_overhead_s

    def prefill_s(self, tokens, context: float = 0.0):
        """Prefill `tokens` new tokens (compute bound) on top of `context` cached tokens."""
        hw, m, tp = self.hw, self.model, self.tp
        attn = 4.0 * m.n_layers * m.attn_dim * tokens * (context + tokens / 2.0)
        flops = 2.0 * m.active_params * tokens + attn
        mem = (self._weight_read_bytes(tokens) / tp) / (hw.hbm_bw * hw.hbm_eff)
        comp = flops / (tp * hw.flops * hw.prefill_mfu)
        return np.maximum(comp, mem) + self._comm_s(tokens) + self.call_overhead_s()

    # ---------------------------------------------------------------- makespan
    def makespan_s(self, requests: Sequence[tuple[int, int]]) -> float:
        """Time for one server to finish `requests` [(prompt_tokens, output_tokens)], all queued at t=0, with
        continuous batching: FIFO admission while the batch is below max_running and the admitted requests'
        final lengths (prompt + output, reserved up front so nothing is ever evicted) fit the KV capacity.
        Each admission burst is one batched prefill call; between completions the batch is fixed and its KV grows by one
        token per request per step, so a run of k steps has a closed-form duration."""
        cap = self.kv_capacity_tokens()
        reqs = [(int(p), int(o)) for p, o in requests]
        for p, o in reqs:
            if p + o > cap:
                raise ValueError(f"request of {p + o} tokens exceeds the TP{self.tp} KV capacity of {cap} tokens")
        t = 0.0
        step = 0  # decode steps done so far (global clock in steps)
        kv = 0.0  # resident KV tokens
        reserved = 0
        running: list[tuple[int, int, int]] = []  # heap of (finish_step, final_len, idx)
        nxt = 0
        ovh = self.call_overhead_s()
        while nxt < len(reqs) or running:
            # admit in order while it fits; one batched prefill call per admission burst
            burst = nxt
            while nxt < len(reqs) and len(running) < self.max_running and reserved + sum(reqs[nxt]) <= cap:
                p, o = reqs[nxt]
                t += float(self.prefill_s(p)) - ovh
                reserved += p + o
                kv += p
                if o == 0:
                    reserved -= p + o
                    kv -= p
                else:
                    heapq.heappush(running, (step + o, p + o, nxt))
                nxt += 1
            if nxt > burst:
                t += ovh
            if not running:
                continue
            b = len(running)
            k = running[0][0] - step  # steps until the next completion
            # sum_{j<k} step(b, kv + j*b) = k*step(b, kv) + slope * b * k(k-1)/2, step linear in kv per regime
            t += self._run_steps(b, kv, k)
            kv += b * k
            step += k
            while running and running[0][0] == step:
                _, final, _ = heapq.heappop(running)
                reserved -= final
                kv -= final
        return t

    def _run_steps(self, batch: int, kv0: float, k: int) -> float:
        """Exact sum of decode_step_s(batch, kv0 + j*batch) for j in 0..k-1: the step time is the max of two
        linear functions of kv, so split the run where they cross."""
        if k <= 0:
            return 0.0
        hw, m, tp = self.hw, self.model, self.tp
        bw = hw.hbm_bw * hw.hbm_eff
        mem0 = self._weight_read_bytes(batch) / tp / bw
        mem_s = self._kv_bytes_gpu / bw  # per KV token
        comp0 = 2.0 * m.active_params * batch / (tp * hw.flops * hw.decode_mfu)
        comp_s = 4.0 * m.n_layers * m.attn_dim / (tp * hw.flops * hw.decode_mfu)
        const = float(self._comm_s(batch)) + self.step_overhead_s() + hw.seq_overhead_s * batch

        def lin(a: float, s: float, j0: int, j1: int) -> float:  # sum over j in [j0, j1) of a + s*(kv0 + j*batch)
            n = j1 - j0
            if n <= 0:
                return 0.0
            return n * (a + s * kv0) + s * batch * (j1 * (j1 - 1) - j0 * (j0 - 1)) / 2.0

        # mem(j) - comp(j) = (mem0 - comp0) + (mem_s - comp_s) * (kv0 + j*batch); find the sign change
        d0 = (mem0 - comp0) + (mem_s - comp_s) * kv0
        ds = (mem_s - comp_s) * batch
        if ds == 0:
            split = k if d0 >= 0 else 0
        else:
            root = -d0 / ds  # mem >= comp for j <= root when ds < 0, for j >= root when ds > 0
            split = int(min(max(np.floor(root) + 1, 0), k)) if ds < 0 else int(min(max(np.ceil(root), 0), k))
        if ds < 0 or (ds == 0 and d0 >= 0):
            total = lin(mem0, mem_s, 0, split) + lin(comp0, comp_s, split, k)
        else:
            total = lin(comp0, comp_s, 0, split) + lin(mem0, mem_s, split, k)
        return total + k * const

    @staticmethod
    def resident_context(mean_prompt, mean_output, window: float = 1.0, resident_output=None):
        """Tokens a running request holds in KV on average: its prompt and half its output, or (asynchronous
        mode) the caller's length-biased `resident_output` (group_makespan_s)."""
        half = mean_output / 2.0 if resident_output is None or window <= 1.0 else resident_output
        return mean_prompt + half

    def evicted_reprefill_s(self, n_req, in_flight, resident_ctx, returns, return_ctx):
        """Re-prefill time of `n_req` requests' tool returns on a server that admits every trajectory the loop
        lets start (AReaL's loop: no working-set admission). The contexts of its `in_flight` trajectories
        (`resident_ctx` tokens each, running or parked on a tool) share the KV cache; SGLang evicts the least
        recently used, so a return finds its context with probability h = min(1, capacity / working set) and
        otherwise prefills it again. Each request has `returns` tool returns with `return_ctx` tokens of
        context on average: n_req x returns x (1 - h) x one prefill of return_ctx. Zero while the working set
        fits (Libra's admission keeps it so)."""
        cap = float(self.kv_capacity_tokens())
        working = np.maximum(np.asarray(in_flight, dtype=float) * resident_ctx, 1.0)
        miss = 1.0 - np.minimum(1.0, cap / working)
        return n_req * returns * miss * self.prefill_s(return_ctx)

    def sustained_concurrency(self, rate, conc, kv_per_req, iters: int = 40):
        """The fewest running requests (at least 1, at most `conc`) whose decode keeps up with `rate` generated
        tokens per second, each holding `kv_per_req` tokens of KV: the smallest c with c / decode_step_s(c) >=
        rate (the left side rises with c). `conc` where even that falls short. Vectorised (bisection)."""
        rate, conc = np.asarray(rate, dtype=float), np.asarray(conc, dtype=float)
        if not self.model.is_moe:
            return self._sustained_dense(rate, conc, np.asarray(kv_per_req, dtype=float))
        lo = np.ones(np.broadcast(rate, conc, np.asarray(kv_per_req)).shape)
        hi = np.maximum(np.broadcast_to(conc, lo.shape), 1.0).copy()
        for _ in range(iters):
            mid = (lo + hi) / 2.0
            ok = mid / self.decode_step_s(mid, mid * kv_per_req) >= rate
            hi = np.where(ok, mid, hi)
            lo = np.where(ok, lo, mid)
        return hi

    def _sustained_dense(self, rate, conc, kv):
        """sustained_concurrency in closed form for a dense model, whose step is affine in each of its two
        regimes: decode_step_s(c, c * kv) = max(mem(c), comp(c)) + fix(c), each term affine in c (decode_parts,
        _comm_s, the overheads). c / step(c) >= rate holds exactly when c >= rate (a + a_fix) / (1 - rate (b +
        b_fix)) for both regimes (never where that denominator is <= 0). The coefficients are read off the step
        model itself at c = 0 and 1, so this stays the bisection's answer (to its tolerance, at 1/40 of the cost)
        whatever those terms hold."""
        def terms(c: float):
            mem, comp = self.decode_parts(c, c * kv)
            return mem, comp, self._comm_s(c) + self.step_overhead_s() + self.hw.seq_overhead_s * c

        at0, at1 = terms(0.0), terms(1.0)
        a_fix, b_fix = at0[2], at1[2] - at0[2]
        need = np.zeros(np.broadcast(rate, conc, kv).shape)
        with np.errstate(divide="ignore", invalid="ignore"):
            for a, a1 in zip(at0[:2], at1[:2]):
                den = 1.0 - rate * (a1 - a + b_fix)
                need = np.maximum(need, np.where(den > 0, rate * (a + a_fix) / den, np.inf))
        return np.clip(need, 1.0, np.maximum(conc, 1.0))

    def group_makespan_s(self, n_req, mean_prompt, mean_output, max_output, max_final, window: float = 1.0,
                         reprefill: bool = True, slot_output: float | None = None, slot_wait_s: float = 0.0,
                         resident_output=None, step_s=0.0):
        """Fluid estimate of the makespan of `n_req` requests (possibly fractional: an even share of an
        interval over several servers) with the given length statistics, on one server. Concurrency is
        limited by max_running and by KV capacity with final lengths reserved. Decode takes the longer of
        (a) the work: total output / concurrency steps at the full batch's step time (each request's KV half
        grown) and (b) the critical path: the longest output's steps, with that request's own KV in the
        batch. Prefill: per-request compute plus one call overhead per admission wave. This is the planner's
        cost function (vectorised over numpy arrays); `makespan_s` is the event-driven version.

        `window` > 1 is the asynchronous (staleness-bounded) mode: `window` = eta + 1 batches are in flight,
        so the sustained concurrency is that of window * n_req requests, the KV pool holds requests at their
        average resident size (nothing is reserved up front; the server preempts when it fills), and the
        longest request only has to finish within the window, i.e. its critical path counts 1/window per
        step. The result is still the time per batch of n_req requests.

        `reprefill` (asynchronous mode only): every training step ends with a weight update that interrupts
        generation and flushes the server's KV cache (AReaL's interruptible generation on SGLang), so the
        requests resident at that moment prefill their context again, once per batch: concurrency x one
        prefill of the average resident context.

        `slot_output` (asynchronous mode only): the loop's in-flight slots instead of one request's critical
        path. At most `window` batches of trajectories are in flight, and a trajectory's slot is held until its
        whole GRPO group has finished: for the group's longest member's decode and for the tool calls that wait
        on it. By Little's law a batch then takes at least E[slot time] / window, with E[slot time] =
        `slot_output` (the expected longest member's generated tokens, E over groups of their maximum) decoded
        at this server's step time (at least the interval's own mean output: a slot is held for its own
        decode too) plus `slot_wait_s` (the expected longest member's tool waits). It replaces
        the critical path of the single longest request, which the loop does not wait for (a straggler is
        trained later; it only holds its slots).

        `resident_output` (asynchronous mode only): the mean generated tokens a running request holds in KV.
        Default mean_output / 2; a caller that knows the spread passes E[o^2] / (2 E[o]): a request stays in
        the running batch for a time that grows with its length, so the batch holds the long ones more often
        than their share (length-biased sampling).

        `step_s` (asynchronous mode only): the step interval the loop runs at, in this model's seconds (0:
        unknown). The window's requests are all in flight only while rollout is the bottleneck; when the loop
        steps slower than its servers could serve, they run just the concurrency that decodes one batch per
        step (Little's law: the smallest c with c / step time(c) >= n_req x mean output / step_s,
        sustained_concurrency). The critical path's request sees that concurrency, not the window's: a
        straggler decodes faster in a batch of 10 than in one of 200. The weight update's re-prefill keeps the
        window's: the loop admits a batch at once, so the requests resident at an update are not the time
        average (priced with the sustained concurrency, Search-R1 at 128 x 16 fell to 0.92x)."""
        cap = float(self.kv_capacity_tokens())
        mean_final = mean_prompt + mean_output
        avg_kv = self.resident_context(mean_prompt, mean_output, window, resident_output)
        in_flight = n_req * window if window > 1.0 else n_req
        per_req_kv = avg_kv if window > 1.0 else mean_final
        conc = np.minimum(np.minimum(in_flight, float(self.max_running)), cap / np.maximum(per_req_kv, 1.0))
        conc = np.maximum(conc, 1e-9)
        t_work = (n_req * mean_output / conc) * self.decode_step_s(conc, conc * avg_kv)
        own_kv = np.maximum(max_final - max_output / 2.0, avg_kv)
        run = conc  # the concurrency the servers run at: the window's, or what the loop's step sustains
        if window > 1.0 and np.any(np.asarray(step_s) > 0):
            run = self.sustained_concurrency(n_req * mean_output / np.maximum(step_s, 1e-9), conc, avg_kv)
            run = np.where(np.asarray(step_s) > 0, run, conc)
        if window > 1.0 and slot_output is not None:
            hold = np.maximum(slot_output, mean_output)  # a slot is held at least for its own decode
            t_crit = (hold * self.decode_step_s(run, run * avg_kv) + slot_wait_s) / window
        else:
            t_crit = max_output * self.decode_step_s(run, np.maximum(run - 1.0, 0.0) * avg_kv + own_kv)
            t_crit = t_crit / max(window, 1.0)
        ovh = self.call_overhead_s()
        prefill = n_req * (self.prefill_s(mean_prompt) - ovh) + ovh * np.maximum(n_req / conc, 1.0)
        if window > 1.0 and reprefill:
            resident = np.minimum(conc, in_flight)
            prefill = prefill + resident * (self.prefill_s(avg_kv) - ovh) + ovh
        return prefill + np.maximum(t_work, t_crit)
