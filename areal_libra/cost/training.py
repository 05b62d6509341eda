"""Training cost model: Megatron-style TP x PP x DP (+ EP for MoE) step time and memory.

Layout on the cluster: TP innermost (inside a node), then PP, then DP, so a TP group stays on NVLink and
DP/PP cross nodes only when the inner groups fill a node.

Per micro-batch and pipeline stage:
    T_f = FLOPs_fwd / (tp * peak * train_mfu) + 2 TP all-reduces per layer + PP send
    T_b = 2 * FLOPs_fwd (+ 1 recomputed forward) / (...) + 2 TP all-reduces per layer + PP send
1F1B: (m + pp - 1) * (T_f + T_b), i.e. bubble fraction (pp-1)/(m+pp-1). (The public formula
(pp-1)T_f + (m-pp+1)(T_f+T_b) + (pp-1)T_b simplifies to m(T_f+T_b) and so drops the bubble.)
DP: gradient reduce-scatter + parameter all-gather (distributed optimizer), the part that cannot hide
behind the last backward is exposed. Plus `logprob_passes` forward-only passes (RL recomputes log-probs).
Memory: bf16 weights, fp32 gradient buffer, fp32 master + Adam moments sharded over DP, activations with
full recomputation (layer inputs of the in-flight micro-batches + one layer's working set + logits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from areal_libra.cost.presets import ClusterSpec, ModelSpec
from areal_libra.cost.rollout import allreduce_s


@dataclass(frozen=True)
class TrainParallel:
    tp: int
    pp: int
    dp: int
    ep: int = 1
    micro_batch: int = 1  # sequences per micro-batch

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def alloc(self, backend: str = "megatron") -> str:
        """AReaL allocation string: megatron:d4t2p1, or the MoE form with a separate expert layout."""
        if self.ep <= 1:
            return f"{backend}:d{self.dp}t{self.tp}p{self.pp}"
        edp = self.gpus // (self.pp * self.ep)
        return f"{backend}:(attn:d{self.dp}p{self.pp}t{self.tp}|ffn:d{edp}p{self.pp}e{self.ep})"


@dataclass(frozen=True)
class BatchStats:
    """What the cost model needs from a batch of sequence lengths."""

    n: int
    tokens: float
    sq_tokens: float  # sum of L^2 (attention FLOPs)
    max_len: int

    @staticmethod
    def of(seq_lengths: Sequence[int]) -> BatchStats:
        if not seq_lengths:
            raise ValueError("a training step needs at least one sequence")
        return BatchStats(len(seq_lengths), float(sum(seq_lengths)), float(sum(x * x for x in seq_lengths)),
                          int(max(seq_lengths)))


@dataclass
class TrainCost:
    cluster: ClusterSpec
    model: ModelSpec
    recompute: bool = True  # full activation recomputation
    logprob_passes: int = 1  # forward-only passes per step (proximal/old log-probs)
    dp_overlap: float = 0.8  # share of the gradient all-reduce hidden behind the last backward
    _stats_cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def identity(self) -> tuple:
        """What the model's prices depend on (every compared field): a key for caching its results."""
        return tuple(getattr(self, f.name) for f in fields(self) if f.compare)

    def _stats(self, seq_lengths: Sequence[int] | BatchStats) -> BatchStats:
        if isinstance(seq_lengths, BatchStats):
            return seq_lengths
        key = tuple(seq_lengths)
        st = self._stats_cache.get(key)
        if st is None:
            st = self._stats_cache[key] = BatchStats.of(key)
        return st

    # ---------------------------------------------------------------- checks
    def check(self, par: TrainParallel, seq_lengths: Sequence[int] | BatchStats) -> str | None:
        """None if the layout is valid for this model, batch and cluster; else why not."""
        m, c = self.model, self.cluster
        st = self._stats(seq_lengths)
        if min(par.tp, par.pp, par.dp, par.ep, par.micro_batch) < 1:
            return "all parallel degrees must be >= 1"
        if par.tp > c.gpus_per_node:
            return f"TP {par.tp} exceeds a node ({c.gpus_per_node} GPUs)"
        if par.gpus > c.n_gpus:
            return f"{par.gpus} GPUs exceed the cluster's {c.n_gpus}"
        if m.n_layers % par.pp:
            return f"PP {par.pp} does not divide {m.n_layers} layers"
        if m.n_heads % par.tp:
            return f"TP {par.tp} does not divide {m.n_heads} attention heads"
        if par.ep > 1 and (not m.is_moe or m.n_experts % par.ep or par.dp % par.ep):
            return f"EP {par.ep} needs an MoE model whose experts and DP {par.dp} it divides"
        # AReaL's trainer balances tokens over DP ranks, so DP need not divide the batch; every rank needs
        # at least one micro-batch of sequences.
        if st.n < par.dp * par.micro_batch:
            return f"global batch {st.n} is smaller than DP {par.dp} x micro-batch {par.micro_batch}"
        return None

    def n_micro(self, par: TrainParallel, st: BatchStats) -> int:
        """Micro-batches per DP rank: the busiest rank's sequences (ceil) in micro-batches of `micro_batch`."""
        return -(-st.n // (par.dp * par.micro_batch))

    # ---------------------------------------------------------------- time
    def _fwd_flops(self, tokens: float, sq_tokens: float) -> float:
        m = self.model
        # 2 FLOPs per active parameter per token; causal attention QK^T and AV: 2 * 2 * L^2/2 * attn_dim
        return 2.0 * m.active_params * tokens + 2.0 * m.n_layers * m.attn_dim * sq_tokens

    def _tp_comm_s(self, par: TrainParallel, tokens: float) -> float:
        """Two all-reduces of the activations per layer in one pass (forward or backward) of one stage."""
        m = self.model
        return 2 * (m.n_layers / par.pp) * allreduce_s(self.cluster.hardware, tokens * m.hidden * m.dtype_bytes,
                                                        par.tp, par.tp)

    def breakdown(self, par: TrainParallel, seq_lengths: Sequence[int] | BatchStats) -> dict[str, float]:
        """Per-step time components in seconds (see module docstring)."""
        st = self._stats(seq_lengths)
        why = self.check(par, st)
        if why:
            raise ValueError(why)
        hw, m = self.cluster.hardware, self.model
        n_mb = self.n_micro(par, st)
        # Tokens are balanced over DP ranks (AReaL's dispatch) and spread over a rank's micro-batches; with a
        # batch DP does not divide, a rank runs ceil(n / (dp * mb)) micro-batches of its tokens / dp share.
        mb_tokens = st.tokens / (par.dp * n_mb)
        mb_sq = st.sq_tokens / (par.dp * n_mb)
        rate = par.tp * par.pp * hw.flops * hw.train_mfu
        f_compute = self._fwd_flops(mb_tokens, mb_sq) / rate
        tp_comm = self._tp_comm_s(par, mb_tokens)
        pp_send = 0.0
        if par.pp > 1:
            act = mb_tokens * m.hidden * m.dtype_bytes
            pp_send = hw.comm_latency_s + act / hw.link_bw(2, par.tp * par.pp)
        t_f = f_compute + tp_comm + pp_send
        t_b = (2.0 + (1.0 if self.recompute else 0.0)) * f_compute + tp_comm * (2 if self.recompute else 1) + pp_send
        pipeline = (n_mb + par.pp - 1) * (t_f + t_b)
        logprob = self.logprob_passes * (n_mb + par.pp - 1) * t_f
        # DP gradient sync: distributed optimizer = reduce-scatter + all-gather, same volume as all-reduce.
        grad_bytes = self._local_params(par) * m.dtype_bytes
        dp_span = par.gpus
        ar = allreduce_s(hw, grad_bytes, par.dp, dp_span) if par.dp > 1 else 0.0
        exposed = max((1.0 - self.dp_overlap) * ar, ar - t_b) if ar > 0 else 0.0
        # Optimizer update: read/write fp32 master + moments of the local shard (memory bound).
        optim = 16.0 * self._local_params(par) / par.dp / (hw.hbm_bw * hw.hbm_eff)
        bubble = (par.pp - 1) / (n_mb + par.pp - 1)
        return {
            "t_f": t_f,
            "t_b": t_b,
            "pipeline": pipeline,
            "logprob": logprob,
            "dp_allreduce": ar,
            "dp_exposed": exposed,
            "optimizer": optim,
            "bubble": bubble,
            "tp_comm_ratio": tp_comm * (3 if self.recompute else 2) / max(f_compute * (3.0 + self.recompute), 1e-30),
            "micro_batches": float(n_mb),
            "total": pipeline + logprob + exposed + optim,
        }

    def step_time_s(self, par: TrainParallel, seq_lengths: Sequence[int] | BatchStats) -> float:
        """Seconds for one training step over the global batch `seq_lengths` (one entry per sequence)."""
        return self.breakdown(par, seq_lengths)["total"]

    # ---------------------------------------------------------------- memory
    def _local_params(self, par: TrainParallel) -> float:
        m = self.model
        return m.dense_params / (par.tp * par.pp) + m.expert_params / (par.tp * par.pp * par.ep)

    def memory_breakdown(self, par: TrainParallel, seq_lengths: Sequence[int] | BatchStats) -> dict[str, float]:
        """Bytes per GPU on the most loaded (first/last) pipeline stage."""
        st = self._stats(seq_lengths)
        m, hw = self.model, self.cluster.hardware
        local = self._local_params(par)
        tokens = par.micro_batch * st.max_len  # the heaviest micro-batch
        layers = m.n_layers / par.pp
        inflight = min(par.pp, max(1, self.n_micro(par, st)))  # 1F1B: first stage holds pp
        h = m.hidden
        # Korthikanti et al.: ~34*s*b*h bytes per layer without recompute (flash attention, TP-sharded).
        layer_full = 34.0 * tokens * h / par.tp
        if self.recompute:
            acts = inflight * layers * tokens * h * m.dtype_bytes + layer_full
        else:
            acts = inflight * layers * layer_full
        logits = tokens * m.vocab * 4.0 / par.tp  # fp32 logits of the last stage
        return {
            "weights": local * m.dtype_bytes,
            "grads": local * 4.0,
            "optimizer": local * 12.0 / par.dp,
            "activations": acts + logits,
            "workspace": hw.workspace_bytes,
        }

    def memory_bytes(self, par: TrainParallel, seq_lengths: Sequence[int] | BatchStats) -> float:
        return sum(self.memory_breakdown(par, seq_lengths).values())

    def fits(self, par: TrainParallel, seq_lengths: Sequence[int] | BatchStats) -> bool:
        return self.memory_bytes(par, seq_lengths) <= self.cluster.hardware.hbm_bytes

