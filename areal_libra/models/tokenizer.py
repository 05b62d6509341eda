"""A small byte-level BPE tokenizer built offline with `tokenizers`, saved as a PreTrainedTokenizerFast.

Digits and punctuation are split into single tokens (so arithmetic stays learnable character by
character); merges come from a corpus of the task's own text, so DAPO's instruction costs few tokens.
The tool markup tags are single tokens, which lets generation stop on the `</calc>` token id."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from areal_libra.workflows.markup import TOOL_TOKENS

EOS = "<|endoftext|>"
PAD = "<|pad|>"
# Concatenates message contents; the completion starts after the last newline. Real models use their own.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}\n{% endfor %}"


def build_tokenizer(corpus: Iterable[str], vocab_size: int = 384):
    """Train the BPE on `corpus` and wrap it as a transformers PreTrainedTokenizerFast."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.Punctuation(behavior="isolated"),
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
    tok.train_from_iterator(corpus, trainer=trainer)
    # Tool tags are ordinary (non-special) added tokens: they must survive decode(skip_special_tokens=True).
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in TOOL_TOKENS])
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
