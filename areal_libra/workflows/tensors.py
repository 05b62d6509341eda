"""The batch row AReaL's trainer takes from one episode: token ids, loss mask, logprobs, weight versions,
attention mask and reward, each with a leading batch dimension of 1 (what `arun_episode` returns)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def episode_tensors(seq: Sequence[int], loss_mask: Sequence[int], logprobs: Sequence[float],
                    versions: Sequence[int], reward: float, **extra: torch.Tensor) -> dict[str, torch.Tensor]:
    """One episode as AReaL's trajectory dict; `extra` adds scalar tensors (e.g. emulated token counts)."""
    if not len(seq) == len(loss_mask) == len(logprobs) == len(versions):
        raise ValueError(f"episode columns differ in length: seq {len(seq)}, loss_mask {len(loss_mask)}, "
                         f"logprobs {len(logprobs)}, versions {len(versions)}")
    res = {
        "input_ids": torch.tensor(seq, dtype=torch.int32),
        "loss_mask": torch.tensor(loss_mask, dtype=torch.int32),
        "logprobs": torch.tensor(logprobs, dtype=torch.float32),
        "versions": torch.tensor(versions, dtype=torch.int32),
        "attention_mask": torch.ones(len(seq), dtype=torch.bool),
        "rewards": torch.tensor(reward, dtype=torch.float32),
        **extra,
    }
    return {k: v.unsqueeze(0) for k, v in res.items()}
