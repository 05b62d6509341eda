"""Batched token sampling with per-request, batch-independent randomness.

Every row draws its uniform from a counter-based hash of (request seed, token index), so a request's
sampled tokens do not depend on which other requests share its batch or on arrival timing: the same seed
and prompt give the same output whether it ran alone or among 128 others (up to float rounding of the
batched forward). Sampling is inverse-CDF over the filtered distribution, one uniform per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF
_C = 0x45D9F3B  # < 2**31, so (x < 2**32) * _C stays inside int64


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A well-mixed 32-bit integer hash on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * _C) & _M32
    x = x ^ (x >> 16)
    x = (x * _C) & _M32
    return x ^ (x >> 16)


def uniforms(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Uniform floats in [0, 1) (float64, 48 random bits) from per-row seeds and counters (int64)."""
    s = seeds & _M32
    c = counters & _M32
    h1 = _hash32(s ^ _hash32(c + 0x9E3779B))
    h2 = _hash32(h1 ^ _hash32(c + 0x7F4A7C15) ^ 0x2545F491)
    hi = (h1 >> 8).to(torch.float64)
    lo = (h2 >> 8).to(torch.float64)
    return (hi * 16777216.0 + lo) / 281474976710656.0


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as tensors (row i of each tensor belongs to batch row i)."""

    temperature: torch.Tensor  # float32 [B]; 0 = greedy
    top_p: torch.Tensor  # float32 [B]
    top_k: torch.Tensor  # int64 [B]; <= 0 = all
    seed: torch.Tensor  # int64 [B]
    counter: torch.Tensor  # int64 [B]: index of the token being sampled for that request
    frequency_penalty: torch.Tensor | None = None  # float32 [B]
    presence_penalty: torch.Tensor | None = None  # float32 [B]
    token_counts: torch.Tensor | None = None  # float32 [B, V]: output-token counts, for the penalties


def sample(logits: torch.Tensor, sp: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row. Returns (token ids int64 [B], logprobs float32 [B]).

    The logprob is log_softmax(logits / temperature) of the sampled token (greedy rows: temperature 1),
    after penalties and before top-k/top-p filtering, as SGLang reports it.
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    if sp.token_counts is not None:
        counts = sp.token_counts
        if sp.frequency_penalty is not None:
            logits = logits - sp.frequency_penalty[:, None] * counts
        if sp.presence_penalty is not None:
            logits = logits - sp.presence_penalty[:, None] * (counts > 0).float()
    greedy = sp.temperature <= 0
    temp = torch.where(greedy, torch.ones_like(sp.temperature), sp.temperature)
    logp = torch.log_softmax(logits / temp[:, None], dim=-1)
    probs = logp.exp()

    k = torch.where(sp.top_k <= 0, torch.full_like(sp.top_k, vocab), sp.top_k.clamp(max=vocab))
    if bool((k < vocab).any()):
        kmax = int(k.max())
        top_vals = torch.topk(probs, kmax, dim=-1).values
        thresh = top_vals.gather(1, (k - 1).clamp(min=0)[:, None])
        probs = torch.where(probs >= thresh, probs, torch.zeros_like(probs))
    if bool((sp.top_p < 1.0).any()):
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        total = sorted_p.sum(-1, keepdim=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token
        drop = before >= sp.top_p[:, None] * total
        drop[:, 0] = False  # the most likely token always stays (a top_p that rounds to 0 in float32)
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(1, order, sorted_p)

    cdf = probs.double().cumsum(-1)
    u = uniforms(sp.seed, sp.counter) * cdf[:, -1]
    tok = torch.searchsorted(cdf, u[:, None], right=True).squeeze(1).clamp(max=vocab - 1)
    if bool(greedy.any()):
        tok = torch.where(greedy, logits.argmax(-1), tok)
    return tok, logp.gather(1, tok[:, None]).squeeze(1)
