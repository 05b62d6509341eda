"""A tiny random Qwen2 model and a character-level tokenizer, built offline.

Tests and benchmarks of the embedded server need a real Hugging Face checkpoint without any download;
this writes one (config, safetensors weights, tokenizer.json) into a directory in well under a second.
It is not the project's default policy model (that one is trained); it only has the right format.
"""

from __future__ import annotations

import os
import string
from dataclasses import dataclass

from areal_libra.models.shape import Qwen2Shape

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
# Small enough for a ~40-token vocabulary, rich enough for "What is 3+4? Answer: 7" style text.
DEFAULT_ALPHABET = string.digits + "+-*/=()<>?:. " + "ACDEIRSWacdehilnorstuw\n"
# Smaller than the policy (models/shape.TINY_QWEN2), with untied embeddings (see build_tiny_model); the
# vocabulary is the character tokenizer's.
RANDOM_TINY_SHAPE = Qwen2Shape(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False)


@dataclass(frozen=True)
class TinyModelSpec:
    shape: Qwen2Shape = RANDOM_TINY_SHAPE
    alphabet: str = DEFAULT_ALPHABET
    seed: int = 0


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET):
    """A character-level fast tokenizer: one token per character plus EOS and PAD."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(alphabet))  # dedupe, keep order
    vocab = {EOS_TOKEN: 0, PAD_TOKEN: 1}
    for ch in chars:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)
    return hf


def build_tiny_model(out_dir: str, spec: TinyModelSpec | None = None) -> str:
    """Write a random Qwen2 causal LM and its tokenizer to ``out_dir``; returns ``out_dir``."""
    import torch
    from transformers import Qwen2ForCausalLM

    spec = spec or TinyModelSpec()
    tokenizer = build_char_tokenizer(spec.alphabet)
    config = spec.shape.hf_config(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(config)
    # Untied, unit-variance embeddings and a wider output layer: sampled text is varied (entropy ~3.5
    # nats) and two seeds give clearly different distributions, which the contract tests rely on.
    # Sharper attention (larger query/key weights) makes outputs depend on positions and on which keys
    # are attended, so cache/mask/RoPE mistakes in a server show up in its logprobs.
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
        model.lm_head.weight.mul_(3.0)
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
