"""Attention for the embedded engine: PyTorch SDPA with native grouped-query attention.

Hugging Face's "sdpa" implementation copies keys and values to every query head (``repeat_kv``) whenever an
attention mask is given, which the batched engine always does; on CPU that copy cost ~7x the attention
itself (128 rows, 100 positions, 4 query / 2 key-value heads: 5.7 ms vs 0.8 ms per layer). SDPA's
``enable_gqa`` reads the shared key/value heads directly and gives identical results.
"""

from __future__ import annotations

from typing import Any

import torch

NAME = "areal_libra_sdpa"


def gqa_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Same contract as transformers' sdpa_attention_forward: [B, H, T, D] in, [B, T, H, D] out."""
    causal = attention_mask is None and query.shape[2] > 1 and (is_causal if is_causal is not None else True)
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=0.0,
        scale=scaling,
        is_causal=causal,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def use_gqa_attention(model: torch.nn.Module) -> bool:
    """Switch a Hugging Face model to this attention; False (model unchanged) if it cannot switch."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, gqa_sdpa_attention)
    try:
        model.set_attn_implementation(NAME)
    except Exception:
        return False
    return getattr(model.config, "_attn_implementation", None) == NAME
