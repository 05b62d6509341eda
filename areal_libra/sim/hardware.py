"""The simulator's "hardware truth": how long a decode iteration, a prefill or a training step takes.

Deliberately independent of `areal_libra.cost` (the planner's Cost Evaluator): it shares only the public
spec sheet (FLOP/s, HBM and link bandwidths, memory, model shapes) and adds effects the planner's
analytic model leaves out — per-sequence host/scheduler overhead that does not shrink with TP, attention
FLOPs growing with the resident context, all-reduce latency, memory-fraction limits on KV capacity,
pipeline bubbles, partially exposed gradient all-reduce, and multiplicative noise. So the planner can
mispredict, as it does on real hardware.

The constants were chosen so a single server reproduces the public vLLM decode benchmark
(Mistral-7B on A100, 320 prompts x 2,000 tokens, TP1/2/4/8) within 25%; `tests/test_sim_hardware.py` checks it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class GpuSpec:
    name: str
    flops: float  # dense bf16 peak, FLOP/s
    hbm_bw: float  # bytes/s
    mem_bytes: float
    nvlink_bw: float  # bytes/s per GPU inside a node
    internode_bw: float  # bytes/s per GPU between nodes
    gpus_per_node: int = 8


@dataclass(frozen=True)
class ModelShape:
    name: str
    params: float  # total parameters
    active_params: float  # parameters touched per token (== params for dense models)
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def weight_bytes(self) -> float:
        return 2.0 * self.params

    @property
    def kv_bytes_per_token(self) -> float:
        return self.layers * self.kv_heads * self.head_dim * 2 * 2.0

    @property
    def attn_dim(self) -> int:
        return self.heads * self.head_dim


# Spec sheets (public numbers). The simulator falls back on these when the planner's
# presets are not importable; otherwise `truth_from_presets` reads the same facts from them.
GPUS: dict[str, GpuSpec] = {
    "a800": GpuSpec("a800", 312e12, 2.0e12, 80 * GB, 400 * GB, 100 * GB / 4),
    "a100": GpuSpec("a100", 312e12, 2.0e12, 80 * GB, 600 * GB, 100 * GB / 4),
    "h100": GpuSpec("h100", 990e12, 3.35e12, 80 * GB, 900 * GB, 400 * GB / 8),
}
MODELS: dict[str, ModelShape] = {
    "qwen3-14b": ModelShape("qwen3-14b", 14.8e9, 14.8e9, 40, 5120, 40, 8, 128),
    "qwen3-8b": ModelShape("qwen3-8b", 8.2e9, 8.2e9, 36, 4096, 32, 8, 128),
    "qwen3-30b-a3b": ModelShape("qwen3-30b-a3b", 30.5e9, 3.3e9, 48, 2048, 32, 4, 128),
    "mistral-7b": ModelShape("mistral-7b", 7.24e9, 7.24e9, 32, 4096, 32, 8, 128),
    "qwen2.5-7b": ModelShape("qwen2.5-7b", 7.6e9, 7.6e9, 28, 3584, 28, 4, 128),
}


@dataclass(frozen=True)
class TruthConstants:
    """Efficiencies and overheads of the truth model (not exposed to the planner)."""

    hbm_eff: float = 0.78  # achieved fraction of HBM bandwidth in decode
    decode_flop_eff: float = 0.45
    prefill_flop_eff: float = 0.55
    host_overhead_s: float = 4e-3  # per decode iteration: scheduler, sampling launch
    host_per_seq_s: float = 4.0e-4  # per running sequence per iteration (CPU-side batch bookkeeping)
    allreduce_latency_s: float = 10e-6  # small-message all-reduce inside a node (custom one-shot kernel)
    mem_fraction: float = 0.88  # SGLang mem_fraction_static
    workspace_bytes: float = 3.0 * GB  # activations / CUDA graphs per GPU
    train_mfu: float = 0.42  # base model FLOP utilisation of a training step
    train_tp_overhead: float = 0.07  # per doubling of TP inside a node
    train_tp_internode_overhead: float = 0.9
    grad_allreduce_exposed: float = 0.35
    optimizer_s: float = 1.5
    noise_sigma: float = 0.05  # per-iteration multiplicative noise (log-normal sigma)
    server_sigma: float = 0.03  # persistent per-server speed factor
    train_noise_sigma: float = 0.03


class HardwareTruth:
    """Ground-truth timings for one GPU type and model."""

    def __init__(self, gpu: GpuSpec, model: ModelShape, consts: TruthConstants | None = None):
        self.gpu = gpu
        self.model = model
        self.c = consts or TruthConstants()

    # ---------------- rollout ----------------
    def kv_capacity_tokens(self, tp: int, mem_fraction: float | None = None) -> int:
        """KV tokens a TP-`tp` server can hold: weights are split across TP, the KV pool lives on all TP GPUs."""
        frac = self.c.mem_fraction if mem_fraction is None else mem_fraction
        free = tp * (self.gpu.mem_bytes * frac - self.c.workspace_bytes) - self.model.weight_bytes
        return max(0, int(free / self.model.kv_bytes_per_token))

    def _allreduce_s(self, tp: int, nbytes: float) -> float:
        if tp <= 1:
            return 0.0
        bw = self.gpu.nvlink_bw if tp <= self.gpu.gpus_per_node else self.gpu.internode_bw
        lat = self.c.allreduce_latency_s * (1.0 + 0.25 * math.log2(tp))  # one-shot kernel, grows slowly
        return lat + 2.0 * (tp - 1) / tp * nbytes / bw

    def decode_coeffs(self, tp: int, batch: int) -> tuple[float, float]:
        """Decode iteration time = a + b * resident_kv_tokens for a batch of `batch` running sequences."""
        m, c = self.model, self.c
        bw = self.gpu.hbm_bw * c.hbm_eff * tp
        fl = self.gpu.flops * c.decode_flop_eff * tp
        mem_a = m.weight_bytes * (m.active_params / m.params if batch < 8 else 1.0) / bw
        mem_b = m.kv_bytes_per_token / bw
        comp_a = 2.0 * m.active_params * batch / fl
        comp_b = 4.0 * m.layers * m.attn_dim / fl
        # Memory- and compute-bound parts overlap; the slower one sets the GPU time.
        gpu_a, gpu_b = (mem_a, mem_b) if mem_a >= comp_a else (comp_a, comp_b + mem_b * 0.5)
        comm = 2 * m.layers * self._allreduce_s(tp, batch * m.hidden * 2.0)
        host = c.host_overhead_s + c.host_per_seq_s * batch
        return host + comm + gpu_a, gpu_b

    def decode_iteration_s(self, tp: int, batch: int, resident_tokens: float) -> float:
        a, b = self.decode_coeffs(tp, batch)
        return a + b * resident_tokens

    def prefill_s(self, tp: int, new_tokens: float, prior_tokens: float = 0.0) -> float:
        """Time to prefill `new_tokens` on top of `prior_tokens` already cached (one request)."""
        if new_tokens <= 0:
            return 0.0
        m, c = self.model, self.c
        flops = 2.0 * m.active_params * new_tokens + 4.0 * m.layers * m.attn_dim * new_tokens * (
            prior_tokens + new_tokens / 2.0
        )
        comp = flops / (self.gpu.flops * c.prefill_flop_eff * tp)
        comm = 2 * m.layers * self._allreduce_s(tp, new_tokens * m.hidden * 2.0)
        return comp + comm

    # ---------------- training ----------------
    def train_memory_ok(self, tp: int, pp: int, dp: int) -> bool:
        """Weights + grads + distributed-optimizer states must fit with room for activations."""
        m = self.model
        shard = m.params / (tp * pp)
        state = shard * (2 + 4) + shard * 12 / dp  # bf16 weights, fp32 grads, Adam+master split over DP
        return state + 12 * GB <= self.gpu.mem_bytes

    def train_step_s(self, seq_lens: list[int] | tuple[int, ...], tp: int, pp: int, dp: int,
                     micro_batches: int | None = None) -> float:
        """One PPO/GRPO step: a forward for the proximal log-probs plus forward+backward, on tp*pp*dp GPUs."""
        m, c = self.model, self.c
        n = tp * pp * dp
        tokens = float(sum(seq_lens))
        sq = float(sum(s * s for s in seq_lens))
        flops = 8.0 * m.active_params * tokens + 8.0 * m.layers * m.attn_dim * sq
        mfu = c.train_mfu / (1.0 + c.train_tp_overhead * math.log2(max(tp, 1)))
        if tp > self.gpu.gpus_per_node:
            mfu /= 1.0 + c.train_tp_internode_overhead
        if not self.train_memory_ok(tp, pp, dp):
            mfu /= 1.33  # falls back to full activation recomputation and CPU-offloaded optimizer
        mb = micro_batches or max(1, min(len(seq_lens) // max(dp, 1), 4 * pp))
        bubble = (pp - 1) / (mb + pp - 1) if pp > 1 else 0.0
        compute = flops / (n * self.gpu.flops * mfu) / (1.0 - bubble)
        grad_bytes = 2.0 * m.params / (tp * pp)
        ar = 0.0
        if dp > 1:
            bw = self.gpu.internode_bw if n > self.gpu.gpus_per_node else self.gpu.nvlink_bw
            ar = 2.0 * (dp - 1) / dp * grad_bytes / bw * c.grad_allreduce_exposed
        return compute + ar + c.optimizer_s

    # ---------------- transfers ----------------
    def weight_sync_s(self, n_rollout_servers: int) -> float:
        """Trainer -> rollout weight broadcast (NCCL over the inter-node fabric) plus update bookkeeping."""
        if n_rollout_servers <= 0:
            return 0.0
        return self.model.weight_bytes / (self.gpu.internode_bw * 4) + 2.0

    def server_start_s(self, tp: int) -> float:
        """Bring up a rollout server on freed GPUs: load weights from host memory and warm CUDA graphs."""
        return self.model.weight_bytes / tp / (20 * GB) + 20.0

    def reshard_s(self, n_gpus: int) -> float:
        """verl colocated switch (train <-> rollout): offload/onload weights and optimizer, reshard."""
        return 2.0 * self.model.weight_bytes * 8 / max(n_gpus, 1) / (20 * GB) + 6.0


def truth_from_specs(hw, model, consts: TruthConstants | None = None) -> HardwareTruth:
    """Build the truth from the planner's preset objects (areal_libra.cost.presets HardwareSpec and
    ModelSpec), reading only their spec-sheet facts, never their efficiency factors."""
    gpu = GpuSpec(hw.name, float(hw.flops), float(hw.hbm_bw), float(hw.hbm_bytes), float(hw.intra_bw),
                  float(hw.inter_bw), int(hw.gpus_per_node))
    shape = ModelShape(model.name, float(model.params), float(model.active_params), int(model.n_layers),
                       int(model.hidden), int(model.n_heads), int(model.n_kv_heads), int(model.head_dim))
    return HardwareTruth(gpu, shape, consts)


def truth_for(gpu: str, model: str, consts: TruthConstants | None = None) -> HardwareTruth:
    g = gpu.lower()
    if g not in GPUS:
        raise ValueError(f"unknown GPU type {gpu!r}; known: {', '.join(sorted(GPUS))}")
    mm = model.lower()
    if mm not in MODELS:
        raise ValueError(f"unknown model {model!r}; known: {', '.join(sorted(MODELS))}")
    return HardwareTruth(GPUS[g], MODELS[mm], consts)
