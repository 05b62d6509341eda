"""A small byte-level BPE tokenizer built offline with `tokenizers`, saved as a PreTrainedTokenizerFast.

Digits and arithmetic operators are always single tokens (so arithmetic and copying stay learnable
symbol by symbol); everything else is merged by a BPE trained on the task's own text, across spaces, so
DAPO's constant instruction costs a handful of tokens (a 22-token prompt instead of ~100 with word-level
pieces: shorter sequences are cheaper on CPU and put the question close to the answer). Any text still
encodes (byte-level). The tool tags are single tokens, so generation can stop on the `</calc>` id."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from areal_libra.workflows.markup import TOOL_TOKENS

EOS = "<|endoftext|>"
PAD = "<|pad|>"
# Concatenates message contents; the completion starts after the last newline. Real models use their own.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}\n{% endfor %}"


def _untagged_pieces(corpus: Iterable[str], tool_tokens: tuple[str, ...]) -> Iterable[str]:
    # At encode time the tags are split off first; train the merges on the same pieces.
    tags_re = re.compile("(" + "|".join(re.escape(t) for t in tool_tokens) + ")")
    for text in corpus:
        for piece in tags_re.split(text):
            if piece and piece not in tool_tokens:
                yield piece


def build_tokenizer(corpus: Iterable[str], vocab_size: int = 512, tool_tokens: tuple[str, ...] = TOOL_TOKENS):
    """Train the BPE on `corpus` and wrap it as a transformers PreTrainedTokenizerFast; `tool_tokens` (the
    task's tags) become single tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.Split(Regex(r"[+\-*/()]"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_untagged_pieces(corpus, tool_tokens), trainer=trainer)
    # Tool tags are ordinary (non-special) added tokens: they must survive decode(skip_special_tokens=True).
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in tool_tokens])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tokenizer(tokenizer, out_dir: str | Path) -> None:
    tokenizer.save_pretrained(str(out_dir))
