"""The code task's markup, shared by the data generator, the tokenizer, the warm-up and the workflow.

The model writes `<py>CODE</py>`; generation stops at `</py>`; the sandbox runs the code on the prompt's
example and the environment appends `<out>RESULT</out>` (`14 ok`, `15 wrong`, an exception name, `Timeout`);
generation resumes. The last code block is the submission, graded on hidden tests."""

from __future__ import annotations

from areal_libra.workflows.markup import trailing_call

CODE_OPEN = "<py>"
CODE_CLOSE = "</py>"
OUT_OPEN = "<out>"
OUT_CLOSE = "</out>"
CODE_TOOL_TOKENS = (CODE_OPEN, CODE_CLOSE, OUT_OPEN, OUT_CLOSE)

CODE_INSTRUCTION = (f"Write the function in {CODE_OPEN}CODE{CODE_CLOSE}; it runs on the example and the "
                    f"result comes back as {OUT_OPEN}RESULT{OUT_CLOSE}.")


def format_output(payload: str) -> str:
    """The text appended to the context after a code block."""
    return f"{OUT_OPEN}{payload}{OUT_CLOSE}"


def run_payload(status: str, output: str | None, error: str | None, ok: bool) -> str:
    """What the model sees of one run on the example: the value and ok/wrong, or why it failed."""
    if status == "timeout":
        return "Timeout"
    if status != "success" or output is None:
        return (error or "Error")[:40]
    return f"{output[:24]} {'ok' if ok else 'wrong'}"


def extract_code(text: str) -> str | None:
    """The code of the block that `text` ends with, or None when it does not end with one."""
    return trailing_call(text, CODE_OPEN, CODE_CLOSE)


def last_code(text: str) -> str | None:
    """The last complete code block anywhere in `text` (the submission), or None."""
    end = text.rfind(CODE_CLOSE)
    if end < 0:
        return None
    start = text.rfind(CODE_OPEN, 0, end)
    return None if start < 0 else text[start + len(CODE_OPEN): end]
