"""The shape of a small Qwen2 decoder: the one description of the project's tiny models.

The default policy (models/tiny.py), the random test checkpoint (models/random_tiny.py) and the CPU cost
profile's timed model (cost/profile.py) are instances of Qwen2Shape; each builds its Hugging Face config
from it with `hf_config`. Field names are Qwen2Config's, so a shape is a subset of a config."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import Qwen2Config


@dataclass(frozen=True)
class Qwen2Shape:
    """Defaults: the default policy's shape (0.8M parameters with its 512-token BPE vocabulary)."""

    hidden_size: int = 128
    intermediate_size: int = 352
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    # The vocabulary the model is built for; a builder whose tokenizer fixes the table size passes that
    # size to hf_config (the tiny policy: its BPE target, the table rounded up to a multiple of 64).
    vocab_size: int = 512
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        if min(self.hidden_size, self.intermediate_size, self.num_hidden_layers, self.num_attention_heads,
               self.num_key_value_heads, self.vocab_size, self.max_position_embeddings) < 1:
            raise ValueError(f"{self}: every size must be >= 1")
        if self.num_attention_heads % self.num_key_value_heads:  # grouped-query attention needs it
            raise ValueError(f"{self}: num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads  # as Qwen2's attention computes it

    def hf_config(self, vocab_size: int | None = None, **extra: Any) -> Qwen2Config:
        """The transformers Qwen2Config of this shape; `vocab_size` overrides the shape's, `extra` adds the
        non-shape settings (token ids, rope, dtype)."""
        from transformers import Qwen2Config

        fields = asdict(self)
        if vocab_size is not None:
            fields["vocab_size"] = vocab_size
        return Qwen2Config(**fields, **extra)


TINY_QWEN2 = Qwen2Shape()  # the default policy of every task (models/tiny.py)
