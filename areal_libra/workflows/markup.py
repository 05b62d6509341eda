"""The tool-call markup shared by the data generator, the tokenizer, the warm-up and the workflow.

The model writes `<calc>EXPR</calc>`; generation stops at `</calc>`; the environment appends
`<result>VALUE</result>` and generation resumes. The final line is DAPO's `Answer: N`.
"""

from __future__ import annotations

CALC_OPEN = "<calc>"
CALC_CLOSE = "</calc>"
RESULT_OPEN = "<result>"
RESULT_CLOSE = "</result>"
TOOL_TOKENS = (CALC_OPEN, CALC_CLOSE, RESULT_OPEN, RESULT_CLOSE)

TOOL_INSTRUCTION = (
    f"You may evaluate an arithmetic expression by writing {CALC_OPEN}EXPRESSION{CALC_CLOSE}; "
    f"its value comes back as {RESULT_OPEN}VALUE{RESULT_CLOSE}."
)


def format_result(payload: str) -> str:
    """The text appended to the context after a tool call."""
    return f"{RESULT_OPEN}{payload}{RESULT_CLOSE}"


def trailing_call(text: str, open_tag: str, close_tag: str) -> str | None:
    """The body of the `open_tag...close_tag` call that `text` ends with (unstripped), or None when it does
    not end with one. Every workflow's tool-call parser."""
    stripped = text.rstrip()
    if not stripped.endswith(close_tag):
        return None
    body = stripped[: -len(close_tag)]
    start = body.rfind(open_tag)
    return None if start < 0 else body[start + len(open_tag) :]


def extract_call(text: str) -> str | None:
    """The expression of the tool call that `text` ends with, or None when it does not end with one."""
    body = trailing_call(text, CALC_OPEN, CALC_CLOSE)
    return None if body is None else body.strip()
