"""CodeSandboxWorkflow: the R2E-Gym shape in miniature for AReaL's rollout loop.

The model writes a function in `<py>...</py>`; generation stops at `</py>`; the sandbox (sandbox.py: a
separate process, no network, no writes outside a temp dir, CPU/memory/time limits) runs it on the prompt's
visible example and `<out>14 ok</out>` / `<out>15 wrong</out>` / `<out>SyntaxError</out>` / `<out>Timeout</out>`
is appended (loss-masked); the model may try again. The reward is the fraction of the hidden tests that the
last code block passes, run in the same sandbox. The episode loop, the C-MLFQ request metadata (tool name
`python`) and the Trajectory sent to the sink are MathToolWorkflow's."""

from __future__ import annotations

from typing import Any

from areal_libra.workflows.code_data import row_tests
from areal_libra.workflows.code_markup import CODE_CLOSE, extract_code, format_output, last_code, run_payload
from areal_libra.workflows.math_tool import MathToolWorkflow
from areal_libra.workflows.sandbox import CodeSandboxPool, get_code_sandbox
from areal_libra.workflows.sink import set_trajectory_sink  # noqa: F401 - re-exported for the sink lookup

Tests = list[tuple[list[Any], Any]]


def run_example(code: str, example: Tests, pool: CodeSandboxPool | None = None) -> tuple[str, str, float]:
    """(status, the model-facing text inside <out>, latency) of running `code` on the visible example."""
    pool = pool or get_code_sandbox()
    r = pool.call(code, example)
    return r.status, run_payload(r.status, r.outputs[0] if r.outputs else None, r.error, all(r.passed)), r.latency_s


def grade(code: str | None, tests: Tests, pool: CodeSandboxPool | None = None) -> float:
    """The reward: the fraction of `tests` that `code` passes (0 without code)."""
    if code is None or not tests:
        return 0.0
    return (pool or get_code_sandbox()).call(code, tests).fraction


class CodeSandboxWorkflow(MathToolWorkflow):
    close_tag = CODE_CLOSE

    def make_tool(self, workers: int, timeout_s: float) -> CodeSandboxPool:
        return get_code_sandbox(size=workers, timeout_s=timeout_s)

    def extract(self, text: str) -> str | None:
        return extract_code(text)

    async def call_tool(self, call: str, data: dict[str, Any]) -> tuple[str, str, float]:
        example, _ = row_tests(data)
        r = await self.tool.acall(call, example)
        text = run_payload(r.status, r.outputs[0] if r.outputs else None, r.error, all(r.passed))
        return r.status, format_output(text), r.latency_s

    async def compute_reward(self, prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int],
                             data: dict[str, Any]) -> float:
        _, hidden = row_tests(data)
        code = last_code(completion)
        if code is None:
            return 0.0
        return (await self.tool.acall(code, hidden)).fraction
