"""One episode's token columns as AReaL's trainer takes them: token ids, loss mask, logprobs, weight versions,
attention mask and reward, each with a leading batch dimension of 1 (what `arun_episode` returns). Shared by
the real workflows (workflows/math_tool.py and its subclasses) and the emulated one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Episode:
    """The columns as they grow: context (the prompt, tool outputs) is out of the loss, with logprob 0 and
    version -1; model output carries the server's logprobs and weight versions."""

    seq: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def add_context(self, ids: Sequence[int]) -> None:
        self.seq += ids
        self.logprobs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)
        self.versions += [-1] * len(ids)

    def add_output(self, resp: Any) -> list[int]:
        """A ModelResponse's tokens (AReaL's output_tokens / output_logprobs / output_versions); returns them."""
        out = list(resp.output_tokens)
        self.seq += out
        self.logprobs += list(resp.output_logprobs)
        self.loss_mask += [1] * len(out)
        self.versions += list(resp.output_versions)
        return out

    def tensors(self, reward: float, **extra: torch.Tensor) -> dict[str, torch.Tensor]:
        return episode_tensors(self.seq, self.loss_mask, self.logprobs, self.versions, reward, **extra)


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
