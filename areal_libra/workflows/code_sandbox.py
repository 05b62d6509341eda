"""CodeSandboxWorkflow: the R2E-Gym shape in miniature for AReaL's rollout loop.

The model writes a function in `<py>...</py>`; generation stops at `</py>`; the sandbox (sandbox.py: a
separate process, no network, no writes outside a temp dir, CPU/memory/time limits) runs it on the prompt's
visible example and `<out>14 ok</out>` / `<out>15 wrong</out>` / `<out>SyntaxError</out>` / `<out>Timeout</out>`
is appended (loss-masked); the model may try again. The reward is the fraction of the hidden tests that the
last code block passes, run in the same sandbox. The episode loop, the C-MLFQ request metadata (tool name
`python`) and the Trajectory sent to the sink are MathToolWorkflow's."""

from __future__ import annotations

import asyncio
from typing import Any

from areal_libra.workflows.code_data import row_tests
from areal_libra.workflows.code_markup import CODE_CLOSE, extract_code, format_output, last_code
from areal_libra.workflows.math_tool import MathToolWorkflow
from areal_libra.workflows.sandbox import CodeSandboxPool, get_code_sandbox, run_example
from areal_libra.workflows.sink import set_trajectory_sink  # noqa: F401 - re-exported for the sink lookup


class CodeSandboxWorkflow(MathToolWorkflow):
    close_tag = CODE_CLOSE

    def make_tool(self, workers: int, timeout_s: float) -> CodeSandboxPool:
        return get_code_sandbox(size=workers, timeout_s=timeout_s)

    def extract(self, text: str) -> str | None:
        return extract_code(text)

    async def call_tool(self, call: str, data: dict[str, Any]) -> tuple[str, str, float]:
        example, _ = row_tests(data)
        status, text, latency_s = await asyncio.to_thread(run_example, call, example, self.tool)
        return status, format_output(text), latency_s

    async def compute_reward(self, prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int],
                             data: dict[str, Any]) -> float:
        _, hidden = row_tests(data)
        code = last_code(completion)
        if code is None:
            return 0.0
        return (await self.tool.acall(code, hidden)).fraction
