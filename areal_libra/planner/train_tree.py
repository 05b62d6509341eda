"""Training decision tree: for a fixed GPU count, enumerate TP -> EP -> PP -> DP/micro-batch level by level
and cut a branch as soon as it is invalid (divisibility), cannot fit in memory even at its most
memory-friendly completion, communicates too much (TP comm/compute > tp_comm_max), has a pipeline bubble
above bubble_max at its best micro-batching, or cannot beat the best step time found so far (a lower
bound without communication). Every cut is recorded with its reason for `--explain`.

`exhaustive` enumerates every layout under the same feasibility rules; the tree must return the same best.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_libra.cost.training import BatchStats, TrainCost, TrainParallel


@dataclass(frozen=True)
class TreeConfig:
    allowed_tp: tuple[int, ...] = (1, 2, 4, 8)
    allowed_ep: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    max_pp: int = 16
    tp_comm_max: float = 0.5  # public Libra rule: prune TP when comm / compute > 0.5
    bubble_max: float = 0.3  # public Libra rule: prune PP when (pp-1)/(m+pp-1) > 0.3


@dataclass(frozen=True)
class PruneRecord:
    level: str  # TP, EP, PP, DP/mb
    branch: str  # e.g. "tp=8 pp=4"
    reason: str
    kind: str  # divisibility | memory | comm | bubble | bound | node


@dataclass
class TreeResult:
    gpus: int
    best: TrainParallel | None = None
    t_s: float = float("inf")
    log: list[PruneRecord] = field(default_factory=list)
    evaluated: int = 0
    min_memory: float = float("inf")  # smallest per-GPU memory seen among valid layouts (for errors)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _feasible(cost: TrainCost, par: TrainParallel, st: BatchStats, cfg: TreeConfig) -> tuple[str, str] | None:
    """(kind, reason) why a complete layout is ruled out, or None."""
    why = cost.check(par, st)
    if why:
        return ("node" if "node" in why else "divisibility"), why
    mem = cost.memory_bytes(par, st)
    hbm = cost.cluster.hardware.hbm_bytes
    if mem > hbm:
        return "memory", f"needs {mem / 1e9:.1f} GB per GPU > {hbm / 1e9:.0f} GB"
    b = cost.breakdown(par, st)
    if b["tp_comm_ratio"] > cfg.tp_comm_max:
        return "comm", f"TP comm/compute {b['tp_comm_ratio']:.2f} > {cfg.tp_comm_max}"
    if b["bubble"] > cfg.bubble_max:
        return "bubble", f"pipeline bubble {b['bubble']:.2f} > {cfg.bubble_max}"
    return None


def _layouts(cost: TrainCost, gpus: int, st: BatchStats, cfg: TreeConfig):
    m = cost.model
    for tp in cfg.allowed_tp:
        for ep in (cfg.allowed_ep if m.is_moe else (1,)):
            for pp in _divisors(m.n_layers):
                if pp > cfg.max_pp or gpus % (tp * pp):
                    continue
                dp = gpus // (tp * pp)
                for mb in cfg.micro_batches:
                    yield TrainParallel(tp, pp, dp, ep, mb)


def exhaustive(cost: TrainCost, gpus: int, st: BatchStats, cfg: TreeConfig) -> tuple[TrainParallel | None, float]:
    """Best layout on exactly `gpus` GPUs by plain enumeration (reference for tests)."""
    best, best_t = None, float("inf")
    for par in _layouts(cost, gpus, st, cfg):
        if _feasible(cost, par, st, cfg) is None:
            t = cost.step_time_s(par, st)
            if t < best_t:
                best, best_t = par, t
    return best, best_t


def _lower_bound(cost: TrainCost, par: TrainParallel, st: BatchStats) -> float:
    """No micro-batch choice beats this for (tp, pp, dp, ep): compute with the smallest bubble (mb=1), the
    unavoidable share of the DP all-reduce and the optimizer, no TP/PP communication."""
    from areal_libra.cost.rollout import allreduce_s

    hw = cost.cluster.hardware
    # A rank's token share in the most micro-batches it can have (micro-batch 1: ceil(n / dp)) gives the
    # smallest bubble; with a batch DP divides this is n/dp + pp - 1 slots of one sequence each.
    per_rank = cost._fwd_flops(st.tokens / par.dp, st.sq_tokens / par.dp) / (par.tp * par.pp * hw.flops * hw.train_mfu)
    m = -(-st.n // par.dp)
    passes = 3.0 + (1.0 if cost.recompute else 0.0) + cost.logprob_passes
    local = cost._local_params(par)
    ar = allreduce_s(hw, local * cost.model.dtype_bytes, par.dp, par.gpus) if par.dp > 1 else 0.0
    optim = 16.0 * local / par.dp / (hw.hbm_bw * hw.hbm_eff)
    return passes * per_rank * (m + par.pp - 1) / m + (1.0 - cost.dp_overlap) * ar + optim


def search(cost: TrainCost, gpus: int, st: BatchStats, cfg: TreeConfig) -> TreeResult:
    """Best layout on exactly `gpus` GPUs, pruning level by level (see module docstring)."""
    m, c = cost.model, cost.cluster
    res = TreeResult(gpus)
    hbm = c.hardware.hbm_bytes
    log = res.log
    max_mb = max(cfg.micro_batches)
    for tp in cfg.allowed_tp:
        br = f"tp={tp}"
        if tp > c.gpus_per_node:
            log.append(PruneRecord("TP", br, f"exceeds a node ({c.gpus_per_node} GPUs)", "node"))
            continue
        if gpus % tp or m.n_heads % tp:
            log.append(PruneRecord("TP", br, f"does not divide {gpus} GPUs / {m.n_heads} heads", "divisibility"))
            continue
        # The most memory-friendly completion: deepest valid PP, largest EP, one sequence per micro-batch.
        pps = [pp for pp in _divisors(m.n_layers) if pp <= cfg.max_pp and (gpus // tp) % pp == 0]
        eps = [ep for ep in cfg.allowed_ep if m.is_moe and m.n_experts % ep == 0 and (gpus // tp) % ep == 0] or [1]
        if not pps:
            log.append(PruneRecord("TP", br, f"no PP degree divides both {m.n_layers} layers and {gpus // tp}",
                                   "divisibility"))
            continue
        # Memory never grows with PP or EP and is smallest at micro-batch 1: if the leanest valid
        # completion does not fit, nothing under this TP does.
        lean = [TrainParallel(tp, pp, gpus // (tp * pp), ep, 1) for pp in pps for ep in eps
                if (gpus // (tp * pp)) % ep == 0]
        lean_mem, lean_par = min(((cost.memory_bytes(p, st), p) for p in lean), key=lambda x: x[0])
        res.min_memory = min(res.min_memory, lean_mem)
        if lean_mem > hbm:
            log.append(PruneRecord("TP", br, f"out of memory even at PP={lean_par.pp} EP={lean_par.ep}: "
                                   f"{lean_mem / 1e9:.1f} GB > {hbm / 1e9:.0f} GB", "memory"))
            continue
        # comm/compute only falls as micro-batches grow (latency amortised): test the largest one.
        probe = BatchStats(1, max_mb * st.tokens / st.n, max_mb * st.sq_tokens / st.n, st.max_len)
        ratio = cost.breakdown(TrainParallel(tp, 1, 1, 1, 1), probe)["tp_comm_ratio"]
        if ratio > cfg.tp_comm_max:
            log.append(PruneRecord("TP", br, f"TP comm/compute {ratio:.2f} > {cfg.tp_comm_max}", "comm"))
            continue
        if m.is_moe:
            for ep in cfg.allowed_ep:
                if ep not in eps:
                    log.append(PruneRecord("EP", f"{br} ep={ep}", f"does not divide both {m.n_experts} experts and "
                                           f"the {gpus // tp} GPUs left after TP", "divisibility"))
        for ep in (eps if m.is_moe else [1]):
            ebr = f"{br} ep={ep}"
            for pp in pps:
                pbr = f"{ebr} pp={pp}"
                dp = gpus // (tp * pp)
                if dp % ep:
                    log.append(PruneRecord("PP", pbr, f"EP {ep} does not divide DP {dp}", "divisibility"))
                    continue
                if st.n < dp:  # token-balanced DP need not divide the batch, but every rank needs a sequence
                    log.append(PruneRecord("PP", pbr, f"global batch {st.n} has fewer sequences than DP {dp}",
                                           "divisibility"))
                    continue
                base = TrainParallel(tp, pp, dp, ep, 1)
                mem1 = cost.memory_bytes(base, st)
                res.min_memory = min(res.min_memory, mem1)
                if mem1 > hbm:
                    log.append(PruneRecord("PP", pbr, f"out of memory at micro-batch 1: {mem1 / 1e9:.1f} GB > "
                                           f"{hbm / 1e9:.0f} GB", "memory"))
                    continue
                m_max = -(-st.n // dp)
                bubble = (pp - 1) / (m_max + pp - 1)
                if bubble > cfg.bubble_max:
                    log.append(PruneRecord("PP", pbr, f"pipeline bubble {bubble:.2f} > {cfg.bubble_max} even "
                                           f"with {m_max} micro-batches", "bubble"))
                    continue
                lb = _lower_bound(cost, base, st)
                if lb >= res.t_s:
                    log.append(PruneRecord("PP", pbr, f"lower bound {lb:.2f} s >= best {res.t_s:.2f} s", "bound"))
                    continue
                for mb in cfg.micro_batches:
                    par = TrainParallel(tp, pp, dp, ep, mb)
                    mbr = f"{pbr} dp={dp} mb={mb}"
                    bad = _feasible(cost, par, st, cfg)
                    if bad:
                        log.append(PruneRecord("DP/mb", mbr, bad[1], bad[0]))
                        continue
                    t = cost.step_time_s(par, st)
                    res.evaluated += 1
                    if t < res.t_s:
                        res.best, res.t_s = par, t
    return res
