"""Search-R1's markup, shared by the corpus generator, the tokenizer, the warm-up and the workflow.

The model writes `<search>QUERY</search>`; generation stops at `</search>`; the environment appends
`<information>PASSAGES</information>` and generation resumes; the final answer is `<answer>A</answer>`.
"""

from __future__ import annotations

import re

from areal_libra.workflows.markup import trailing_call

SEARCH_OPEN = "<search>"
SEARCH_CLOSE = "</search>"
INFO_OPEN = "<information>"
INFO_CLOSE = "</information>"
ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"
SEARCH_TOKENS = (SEARCH_OPEN, SEARCH_CLOSE, INFO_OPEN, INFO_CLOSE, ANSWER_OPEN, ANSWER_CLOSE)

SEARCH_INSTRUCTION = (
    f"Answer the question. You may search a knowledge base by writing {SEARCH_OPEN}QUERY{SEARCH_CLOSE}; "
    f"passages come back as {INFO_OPEN}...{INFO_CLOSE}. Give the answer as {ANSWER_OPEN}ANSWER{ANSWER_CLOSE}."
)

_ANSWER_RE = re.compile(re.escape(ANSWER_OPEN) + r"(.*?)" + re.escape(ANSWER_CLOSE), re.DOTALL)


def format_information(payload: str) -> str:
    """The text appended to the context after a search: the retriever's passages (or its error text)."""
    return f"{INFO_OPEN}{payload}{INFO_CLOSE}"


def extract_query(text: str) -> str | None:
    """The query of the search call that `text` ends with, or None when it does not end with one."""
    body = trailing_call(text, SEARCH_OPEN, SEARCH_CLOSE)
    return None if body is None else body.strip()


def extract_answer(text: str) -> str | None:
    """The content of the last <answer>...</answer> in `text`, or None."""
    found = _ANSWER_RE.findall(text)
    return found[-1] if found else None


def normalize(ans: str) -> str:
    """Search-R1's exact-match normalisation: lower case, no punctuation or articles, single spaces."""
    s = re.sub(r"[^\w\s]", " ", ans.lower())
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def exact_match_reward(prompt, completions, prompt_ids, completion_ids, answer, **kwargs) -> float:
    """AReaL reward-function signature: 1.0 when the last <answer> equals `answer` after normalisation."""
    pred = extract_answer(str(completions))
    if pred is None:
        return 0.0
    golds = answer if isinstance(answer, (list, tuple)) else [answer]
    return 1.0 if any(normalize(pred) == normalize(str(g)) for g in golds) else 0.0
