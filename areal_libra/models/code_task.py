"""The code task for the warm-up, the probe and the tokenizer (areal_libra.models.warmup.WarmupTask).

Demonstrations are deliberately imperfect, as for math: a share of first attempts are miscoded (a constant,
an operation, the order, or a syntax slip); after a wrong run only a share retry (and a retry may be wrong
again). RL then has room to raise first-attempt accuracy and to learn to retry after a failed run."""

from __future__ import annotations

import random

from areal_libra.models.warmup import WarmupConfig, WarmupTask
from areal_libra.workflows.code_data import (
    CodeProblem,
    code_messages,
    demonstration_text,
    generate_code_problems,
    miscode,
    reference_code,
)
from areal_libra.workflows.code_markup import (
    CODE_CLOSE,
    CODE_TOOL_TOKENS,
    extract_code,
    format_output,
    last_code,
    run_payload,
)

PARAMS = {
    "miscode_first": 0.5,  # first attempts that are miscoded
    "retry": 0.5,  # wrong runs followed by another attempt
    "miscode_retry": 0.2,  # retries that are miscoded too
    "probe_new_tokens": 48,
}


def local_run(code: str, p: CodeProblem) -> tuple[str, bool]:
    """(the tool's text, passed) for *trusted* generated code, computed in-process (the warm-up writes tens
    of thousands of demonstrations); the same text a sandbox run gives (tests/workflows check this)."""
    scope: dict = {}
    try:
        exec(compile(code, "<demo>", "exec"), scope)  # noqa: S102 - our own generated code, not the model's
        (args, want), = p.example
        got = scope["f"](*args)
    except Exception as e:  # noqa: BLE001 - the demonstration shows the failure
        return format_output(run_payload("failure", None, type(e).__name__, False)), False
    return format_output(run_payload("success", str(got), None, got == want)), got == want


def demonstration(p: CodeProblem, rng: random.Random, cfg: WarmupConfig) -> list[tuple[str, bool]]:
    """(text, trained) segments: attempts are trained on, the tool's outputs are not (loss-masked in RL)."""
    good = reference_code(p)
    code = miscode(p, rng) if rng.random() < PARAMS["miscode_first"] else good
    out: list[tuple[str, bool]] = []
    for attempt in range(2):
        result, ok = local_run(code, p)
        out += [(demonstration_text(code), True), (result, False)]
        if ok or attempt == 1 or rng.random() >= PARAMS["retry"]:
            break
        code = miscode(p, rng) if rng.random() < PARAMS["miscode_retry"] else good
    return out


def sandbox_tool(p: CodeProblem, code: str) -> str:
    from areal_libra.workflows.sandbox import run_example

    return format_output(run_example(code, p.example)[1])


def sandbox_reward(p: CodeProblem, completion: str) -> float:
    from areal_libra.workflows.sandbox import grade

    return grade(last_code(completion), p.hidden_tests)


def tokenizer_corpus(n: int) -> list[str]:
    rng = random.Random("code-tok")
    corpus = []
    for p in generate_code_problems(n, seed=20_000, id_prefix="tok"):
        prompt = "".join(m["content"] + "\n" for m in code_messages(p))  # = the tokenizer's chat template
        corpus.append(prompt + "".join(text for text, _ in demonstration(p, rng, WarmupConfig())))
    return corpus


CODE_TASK = WarmupTask(
    name="code",
    problems=lambda n, seed, prefix: generate_code_problems(n, seed=seed, id_prefix=prefix),
    messages=code_messages,
    demonstration=demonstration,
    close_tag=CODE_CLOSE,
    extract=extract_code,
    tool=sandbox_tool,
    reward=sandbox_reward,
    tokenizer_corpus=tokenizer_corpus,
    tool_tokens=CODE_TOOL_TOKENS,
    params=PARAMS,
)
