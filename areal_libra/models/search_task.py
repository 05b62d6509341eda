"""The search_r1 task for the warm-up, the probe and the tokenizer (areal_libra.models.warmup.WarmupTask).

Demonstrations are deliberately imperfect, as for math: a share answers without searching (a guess of the
right width, always wrong: the facts are only in the corpus), and a share of the searching ones miscopies
the fact out of the passage. RL then has room to raise search use and copy accuracy. Retrieval in the
warm-up is the retrieval server's own BM25 index, in-process (tens of thousands of demonstrations)."""

from __future__ import annotations

import random
from functools import lru_cache

from areal_libra.models.warmup import WarmupConfig, WarmupTask, corrupt_number
from areal_libra.workflows.retriever import DEFAULT_TOPK
from areal_libra.workflows.search_corpus import SearchQuestion, corpus, generate_questions, question_messages
from areal_libra.workflows.search_markup import (
    ANSWER_CLOSE,
    ANSWER_OPEN,
    SEARCH_CLOSE,
    SEARCH_OPEN,
    SEARCH_TOKENS,
    exact_match_reward,
    extract_query,
    format_information,
)

# The shares of searching and miscopying demonstrations are WarmupConfig's tool_fraction (0.75) and
# corrupt_fraction (0.2), as for math.
PARAMS = {"topk": DEFAULT_TOPK, "probe_new_tokens": 32}
_CLEAN = WarmupConfig(tool_fraction=1.0, corrupt_fraction=0.0)


@lru_cache(maxsize=1)
def _index():
    from areal_libra.workflows.bm25_index import BM25Index

    return BM25Index(corpus())


def search_payload(query: str, topk: int = DEFAULT_TOPK) -> str:
    """What the retrieval server returns for `query`, joined as the workflow's client joins it."""
    return " ".join(h.contents for h in _index().search([query], topk)[0])


def demonstration(q: SearchQuestion, rng: random.Random, cfg: WarmupConfig) -> list[tuple[str, bool]]:
    """(text, trained) segments: the model's turns are trained on, the retrieved passages are not
    (loss-masked in RL)."""
    if rng.random() >= cfg.tool_fraction:
        width = len(q.answer)
        return [(f"{ANSWER_OPEN}{rng.randint(10 ** (width - 1), 10 ** width - 1)}{ANSWER_CLOSE}", True)]
    said = corrupt_number(q.answer, rng) if rng.random() < cfg.corrupt_fraction else q.answer
    return [(f"{SEARCH_OPEN}{q.query}{SEARCH_CLOSE}", True),
            (format_information(search_payload(q.query, PARAMS["topk"])), False),
            (f"{ANSWER_OPEN}{said}{ANSWER_CLOSE}", True)]


def _messages(q: SearchQuestion) -> list[dict[str, str]]:
    return question_messages(q.question)


def _tool(q: SearchQuestion, query: str) -> str:
    return format_information(search_payload(query, PARAMS["topk"]))


def _reward(q: SearchQuestion, completion: str) -> float:
    return exact_match_reward("", completion, [], [], q.answer)


def _corpus(n: int) -> list[str]:
    """Whole episodes as the model sees them: the chat-rendered prompt, then a clean searching episode."""
    rng = random.Random(0)
    return ["".join(m["content"] + "\n" for m in _messages(q))  # = the tokenizer's chat template
            + "".join(text for text, _ in demonstration(q, rng, _CLEAN))
            for q in generate_questions(n, seed=20_000, id_prefix="tok")]


SEARCH_TASK = WarmupTask("search_r1", lambda n, seed, prefix: generate_questions(n, seed=seed, id_prefix=prefix),
                         _messages, demonstration, SEARCH_CLOSE, extract_query, _tool, _reward, _corpus,
                         SEARCH_TOKENS, PARAMS)
