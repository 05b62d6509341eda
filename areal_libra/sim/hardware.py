"""The simulator's "hardware truth": how long a decode iteration, a prefill or a training step takes.

Deliberately independent of `areal_libra.cost` (the planner's Cost Evaluator): it shares only the public
spec sheet — `areal_libra/presets/{hardware,models}.yaml`, read here for FLOP/s, HBM and link bandwidths,
memory and model shapes, never for the planner's efficiency factors — and adds effects the planner's
analytic model leaves out: separate efficiencies for reading weights and reading KV, attention over the
resident context, all-reduce latency, memory-fraction limits on KV capacity, pipeline bubbles, partially
exposed gradient all-reduce, and multiplicative noise. So the planner can mispredict, as it does on real
hardware.

Grounding. The GPU part (decode, prefill) reproduces per-layer timings measured on one H200 for a
Qwen3-14B-shaped layer (CUDA-graph decode, as SGLang serves it): `tests/data/h200_measured.json`, checked by
`tests/sim/test_sim_truth_measured.py` (decode within 15% at batch >= 16, prefill within 25%). The same
efficiencies apply to every GPU's spec sheet (the A800 is not measured). The host side is not measured:
SGLANG (the default) exposes a small fixed cost per iteration, as SGLang's overlap scheduler hides its CPU
work behind the GPU step; VLLM_2023 charges the per-running-sequence CPU cost fitted to the public vLLM TP
table (Mistral-7B on A100), which `tests/sim/test_sim_hardware.py` checks within 25%.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

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
    embed_params: float = 0.0  # input embedding table when untied: a decode step gathers rows, never reads it

    @property
    def weight_bytes(self) -> float:
        return 2.0 * self.params

    @property
    def decode_read_bytes(self) -> float:
        """Weights one decode step streams from HBM: every layer and the LM head, not the input table."""
        return 2.0 * (self.params - self.embed_params)

    @property
    def kv_bytes_per_token(self) -> float:
        return self.layers * self.kv_heads * self.head_dim * 2 * 2.0

    @property
    def attn_dim(self) -> int:
        return self.heads * self.head_dim


def gpu_spec(hw) -> GpuSpec:
    """Spec-sheet facts of a planner HardwareSpec (areal_libra.cost.presets)."""
    return GpuSpec(hw.name, float(hw.flops), float(hw.hbm_bw), float(hw.hbm_bytes), float(hw.intra_bw),
                   float(hw.inter_bw), int(hw.gpus_per_node))


def model_shape(model) -> ModelShape:
    """Shape facts of a planner ModelSpec (areal_libra.cost.presets)."""
    emb = 0.0 if model.tie_embeddings else float(model.vocab * model.hidden)
    return ModelShape(model.name, float(model.params), float(model.active_params), int(model.n_layers),
                      int(model.hidden), int(model.n_heads), int(model.n_kv_heads), int(model.head_dim), emb)


def _sheet(kind: str) -> dict:
    from areal_libra.cost.presets import _builtin, load_hardware, load_model

    if kind == "hardware":
        return {k: gpu_spec(load_hardware(k)) for k in _builtin("hardware")}
    return {k: model_shape(load_model(k)) for k in _builtin("models")}


# The one spec sheet: areal_libra/presets/{hardware,models}.yaml (also what the planner's presets read).
GPUS: dict[str, GpuSpec] = _sheet("hardware")
MODELS: dict[str, ModelShape] = _sheet("models")


@dataclass(frozen=True)
class TruthConstants:
    """Efficiencies and overheads of the truth model (not exposed to the planner)."""

    # Fitted to the H200 table (tests/data/h200_measured.json), least squares on relative error over the
    # decode rows with batch >= 16: weight reads by small-M GEMMs reach 65% of peak HBM bandwidth, the
    # attention kernel's streaming KV read 84%; GEMMs at batch 256 run at 60% of peak FLOP/s (the table's
    # large-batch rows), prefill at 63% (the prefill rows: 61-65%).
    weight_read_eff: float = 0.65
    kv_read_eff: float = 0.84
    decode_flop_eff: float = 0.60
    prefill_flop_eff: float = 0.63
    host_overhead_s: float = 5e-4  # exposed per decode iteration (sampling, graph launch), not measured
    host_per_seq_s: float = 0.0  # exposed per running sequence per iteration (CPU-side batch bookkeeping)
    allreduce_latency_s: float = 10e-6  # small-message all-reduce inside a node (custom one-shot kernel)
    mem_fraction: float = 0.88  # SGLang mem_fraction_static
    workspace_bytes: float = 3.0 * GB  # activations / CUDA graphs per GPU
    # Whole PPO step (recompute forward + forward/backward) at TP1; the H200 table's single-layer fwd+bwd runs
    # at 58% of peak without optimizer, embedding, LM head or data movement (tests/test_sim_truth_measured.py
    # holds the truth at 1.0-1.6x of that layer's time).
    train_mfu: float = 0.42
    train_tp_overhead: float = 0.07  # per doubling of TP inside a node
    train_tp_internode_overhead: float = 0.9
    grad_allreduce_exposed: float = 0.35
    optimizer_s: float = 1.5
    # FLOPs per active parameter per trained token: proximal-log-prob forward (2) + forward/backward (6).
    train_passes: float = 8.0
    # Weight update to the rollout servers: weights over `weight_sync_streams` inter-node links in parallel
    # plus a fixed cost (update bookkeeping, or a checkpoint and server restart in the paper-level profile).
    weight_sync_streams: float = 4.0
    weight_sync_fixed_s: float = 2.0
    # Trajectories the environment runs at once (tool sandboxes; the public Libra code's
    # max_concurrent_rollouts); 0 = no limit beyond the staleness bound. A group starts while fewer run.
    max_in_flight: int = 0
    tool_latency_scale: float = 1.0  # tool calls take this multiple of the workload's latency (sandbox speed)
    noise_sigma: float = 0.05  # per-iteration multiplicative noise (log-normal sigma)
    server_sigma: float = 0.03  # persistent per-server speed factor
    train_noise_sigma: float = 0.03


# Serving-engine host profiles (the host side was not measured; see the module docstring).
SGLANG = TruthConstants()
VLLM_2023 = replace(SGLANG, host_overhead_s=4e-3, host_per_seq_s=4.0e-4)
HOST_PROFILES = {"sglang": SGLANG, "vllm-2023": VLLM_2023}

# "paper-level": the costs the default truth leaves out or prices low, at the level the public Libra code
# pays them on 48 A800 (docs/simulator.md, "Where an order of magnitude goes", says why each value is
# plausible). Set so that static_uniform on R2E-Gym lands near the paper's 423 tokens/s in the paper's
# unit; Libra's planner never sees these numbers (planner/, cost/ and control/ import nothing from sim/).
PAPER_LEVEL = replace(
    SGLANG,
    # vLLM as the public code serves (rollout_backend: vllm): the per-sequence host cost fitted to the
    # public vLLM TP table (the vllm-2023 host profile).
    host_overhead_s=VLLM_2023.host_overhead_s,
    host_per_seq_s=VLLM_2023.host_per_seq_s,
    # Megatron-Core at TP8 without Transformer Engine (megatron_use_transformer_engine: false), full
    # activation recomputation (recompute_granularity full, uniform, 1 layer) and 32K-token sequences.
    train_mfu=0.25,
    train_passes=10.0,
    # Weights exported to disk and every vLLM server restarted (weight_sync_mode: disk,
    # rollout_weight_sync_mode: restart), once per 5 steps in the production config: ~150 s per sync,
    # 30 s per step amortised, paid on every step here.
    weight_sync_fixed_s=30.0,
    # At most 16 trajectories in flight (the production config's max_concurrent_rollouts: 16) ...
    max_in_flight=16,
    # ... each waiting on a Docker sandbox: tool calls 8x the workload's latency (bash ~10 s, python ~24 s
    # median). The one value chosen to land static_uniform on R2E-Gym near 423 tokens/s (431, 60 steps).
    tool_latency_scale=8.0,
)
TRUTH_PROFILES = {"default": SGLANG, "paper-level": PAPER_LEVEL}


def truth_constants(profile: str = "default", host: str | None = None) -> TruthConstants:
    """The named truth profile; `host` (HOST_PROFILES) overrides its host-side costs only."""
    if profile not in TRUTH_PROFILES:
        raise ValueError(f"unknown truth profile {profile!r}; known: {', '.join(TRUTH_PROFILES)}")
    c = TRUTH_PROFILES[profile]
    if host is None:
        return c
    if host not in HOST_PROFILES:
        raise ValueError(f"unknown host profile {host!r}; known: {', '.join(HOST_PROFILES)}")
    h = HOST_PROFILES[host]
    return replace(c, host_overhead_s=h.host_overhead_s, host_per_seq_s=h.host_per_seq_s)


class HardwareTruth:
    """Ground-truth timings for one GPU type and model."""

    def __init__(self, gpu: GpuSpec, model: ModelShape, consts: TruthConstants | None = None):
        self.gpu = gpu
        self.model = model
        self.c = consts or TruthConstants()
        self._prefill_k: dict[int, tuple] = {}  # tp -> prefill_s's constants (gpu, model, c are frozen)

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

    def decode_gpu_coeffs(self, tp: int, batch: int) -> tuple[float, float]:
        """GPU time of one decode iteration = a + b * resident_kv_tokens, without host time or all-reduce.
        Linear layers take max(weight read, GEMM FLOPs); attention streams the resident KV."""
        m, c = self.model, self.c
        w_read = m.decode_read_bytes * (m.active_params / m.params if batch < 8 else 1.0)
        mem_a = w_read / (self.gpu.hbm_bw * c.weight_read_eff * tp)
        comp_a = 2.0 * m.active_params * batch / (self.gpu.flops * c.decode_flop_eff * tp)
        mem_b = m.kv_bytes_per_token / (self.gpu.hbm_bw * c.kv_read_eff * tp)
        comp_b = 4.0 * m.layers * m.attn_dim / (self.gpu.flops * c.decode_flop_eff * tp)
        return max(mem_a, comp_a), max(mem_b, comp_b)

    def decode_coeffs(self, tp: int, batch: int) -> tuple[float, float]:
        """Decode iteration time = a + b * resident_kv_tokens for a batch of `batch` running sequences."""
        m, c = self.model, self.c
        gpu_a, gpu_b = self.decode_gpu_coeffs(tp, batch)
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
        k = self._prefill_k.get(tp)
        if k is None:
            k = self._prefill_k[tp] = self._prefill_consts(tp)
        lin, attn, den, layers2, ar_lat, ar_k, hidden, bw = k
        # flops = 2 P n + 4 L D n (prior + n/2); comm = 2 L * all-reduce of n * hidden * 2 bytes. The
        # constant factors are the left-most products of the plain expressions, so every result is the
        # same float as evaluating them in full (this is called once per admitted request).
        flops = lin * new_tokens + attn * new_tokens * (prior_tokens + new_tokens / 2.0)
        comp = flops / den
        if ar_k is None:
            return comp + layers2 * 0.0
        return comp + layers2 * (ar_lat + ar_k * (new_tokens * hidden * 2.0) / bw)

    def _prefill_consts(self, tp: int) -> tuple:
        m, c = self.model, self.c
        if tp <= 1:
            ar_lat = ar_k = bw = None
        else:  # _allreduce_s's terms
            bw = self.gpu.nvlink_bw if tp <= self.gpu.gpus_per_node else self.gpu.internode_bw
            ar_lat = self.c.allreduce_latency_s * (1.0 + 0.25 * math.log2(tp))
            ar_k = 2.0 * (tp - 1) / tp
        return (2.0 * m.active_params, 4.0 * m.layers * m.attn_dim, self.gpu.flops * c.prefill_flop_eff * tp,
                2 * m.layers, ar_lat, ar_k, m.hidden, bw)

    # ---------------- training ----------------
    def train_memory_ok(self, tp: int, pp: int, dp: int) -> bool:
        """Weights + grads + distributed-optimizer states must fit with room for activations."""
        m = self.model
        shard = m.params / (tp * pp)
        state = shard * (2 + 4) + shard * 12 / dp  # bf16 weights, fp32 grads, Adam+master split over DP
        return state + 12 * GB <= self.gpu.mem_bytes

    def train_flops(self, seq_lens: list[int] | tuple[int, ...]) -> float:
        """FLOPs of one PPO step on these sequences: `train_passes` per parameter per token (default: proximal
        forward 2 + forward/backward 6)."""
        m = self.model
        tokens = float(sum(seq_lens))
        sq = float(sum(s * s for s in seq_lens))
        k = self.c.train_passes
        return k * m.active_params * tokens + k * m.layers * m.attn_dim * sq

    def train_step_s(self, seq_lens: list[int] | tuple[int, ...], tp: int, pp: int, dp: int,
                     micro_batches: int | None = None) -> float:
        """One PPO/GRPO step: a forward for the proximal log-probs plus forward+backward, on tp*pp*dp GPUs."""
        m, c = self.model, self.c
        n = tp * pp * dp
        flops = self.train_flops(seq_lens)
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
        return self.model.weight_bytes / (self.gpu.internode_bw * self.c.weight_sync_streams) + self.c.weight_sync_fixed_s

    def server_start_s(self, tp: int) -> float:
        """Bring up a rollout server on freed GPUs: load weights from host memory and warm CUDA graphs."""
        return self.model.weight_bytes / tp / (20 * GB) + 20.0

    def reshard_s(self, n_gpus: int) -> float:
        """verl colocated switch (train <-> rollout): offload/onload weights and optimizer, reshard."""
        return 2.0 * self.model.weight_bytes * 8 / max(n_gpus, 1) / (20 * GB) + 6.0


def truth_from_specs(hw, model, consts: TruthConstants | None = None) -> HardwareTruth:
    """Build the truth from the planner's preset objects (areal_libra.cost.presets HardwareSpec and
    ModelSpec), reading only their spec-sheet facts, never their efficiency factors."""
    return HardwareTruth(gpu_spec(hw), model_shape(model), consts)


def truth_for(gpu: str, model: str, consts: TruthConstants | None = None) -> HardwareTruth:
    g = gpu.lower()
    if g not in GPUS:
        raise ValueError(f"unknown GPU type {gpu!r}; known: {', '.join(sorted(GPUS))}")
    mm = model.lower()
    if mm not in MODELS:
        raise ValueError(f"unknown model {model!r}; known: {', '.join(sorted(MODELS))}")
    return HardwareTruth(GPUS[g], MODELS[mm], consts)
