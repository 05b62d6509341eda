"""Roofline bound of a run: the throughput the same trained trajectories would reach if every GPU ran at its
hardware truth's limit — decode bound by HBM (weights amortised over the largest batch the KV pool and the
engine allow, KV read at the truth's efficiency), prefill once per new token at the truth's prefill FLOP
rate (no re-prefill after weight updates or migrations), training at the truth's MFU (no pipeline bubble,
no exposed all-reduce, no optimizer time) — with perfect balance between rollout and training, no idle
GPU, no tool wait on the critical path and no host overhead. Real systems reach a fraction of it."""

from __future__ import annotations

from collections.abc import Iterable

from areal_libra.sim.hardware import HardwareTruth
from areal_libra.trace import Trajectory


def decode_token_contexts(traj: Trajectory) -> tuple[int, float]:
    """(generated tokens, sum over generated tokens of the context each one attends to)."""
    ctx = traj.prompt_tokens
    n, total = 0, 0.0
    for seg in traj.segments:
        g = seg.gen_tokens
        total += g * ctx + g * (g - 1) / 2.0
        n += g
        ctx += g + (seg.tool.payload_tokens if seg.tool is not None else 0)
    return n, total


def prefill_gpu_s(truth: HardwareTruth, traj: Trajectory) -> float:
    """Prefill of the prompt and of every tool payload on top of the cached context, once each."""
    t = truth.prefill_s(1, traj.prompt_tokens)
    ctx = traj.prompt_tokens
    for seg in traj.segments:
        ctx += seg.gen_tokens
        if seg.tool is not None:
            t += truth.prefill_s(1, seg.tool.payload_tokens, ctx)
            ctx += seg.tool.payload_tokens
    return t


def roofline(truth: HardwareTruth, trajs: Iterable[Trajectory], n_gpus: int, max_running: int = 256) -> dict:
    """GPU-seconds of each phase at the truth's limits and the bound tokens/s on `n_gpus` GPUs."""
    trajs = list(trajs)
    if not trajs or n_gpus < 1:
        return {"roofline_tokens_per_s": 0.0, "decode_gpu_s": 0.0, "prefill_gpu_s": 0.0, "train_gpu_s": 0.0}
    gen, ctx_sum = 0, 0.0
    pre = 0.0
    for tr in trajs:
        n, c = decode_token_contexts(tr)
        gen += n
        ctx_sum += c
        pre += prefill_gpu_s(truth, tr)
    mean_ctx = ctx_sum / max(1, gen)
    # Largest batch a TP8 server's KV pool holds at the mean context (per-GPU cost does not depend on TP
    # when communication is free, so the largest pool gives the best amortisation of the weight read).
    batch = max(1, min(max_running, int(truth.kv_capacity_tokens(8) / max(1.0, mean_ctx))))
    a, b = truth.decode_gpu_coeffs(1, batch)
    decode = gen * a / batch + b * ctx_sum
    train = truth.train_flops([tr.final_length for tr in trajs]) / (truth.gpu.flops * truth.c.train_mfu)
    total = decode + pre + train
    tokens = sum(tr.model_tokens for tr in trajs)
    return {"roofline_tokens_per_s": tokens * n_gpus / total, "decode_gpu_s": decode, "prefill_gpu_s": pre,
            "train_gpu_s": train, "roofline_batch": batch}
