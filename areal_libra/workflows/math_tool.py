"""MathToolWorkflow: agentic multi-turn math with a sandboxed calculator, for AReaL's rollout loop.

One call of `arun_episode` is one trajectory (AReaL's GroupedRolloutWorkflow calls it n_samples times per
prompt to make a GRPO group). Each turn is its own `engine.agenerate` (fresh rid, full prefix re-sent):
generation stops at `</calc>`; the calculator's result is appended as `<result>...</result>` tokens
(loss-masked, logprob 0, version -1) and a new request continues. The episode ends at EOS / a turn
without a tool call, `max_turns`, or `gconfig.max_tokens`. Each request carries the trajectory's state
in `ModelRequest.metadata` (read by the C-MLFQ dispatcher); each finished episode goes to the trajectory
sink as a canonical `Trajectory`."""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections.abc import Callable
from typing import Any

import torch
from areal.api import AsyncRewardWrapper, InferenceEngine, ModelRequest, RolloutWorkflow
from areal.api.cli_args import GenerationHyperparameters
from areal.infra import workflow_context
from areal.utils import stats_tracker
from areal.utils.dynamic_import import import_from_string
from areal.utils.hf_utils import apply_chat_template, load_hf_tokenizer

from areal_libra.trace import Segment, ToolReturn, Trajectory
from areal_libra.workflows.markup import CALC_CLOSE, extract_call, format_result
from areal_libra.workflows.sink import emit, running, set_trajectory_sink  # noqa: F401 - re-exported for the sink lookup
from areal_libra.workflows.tensors import Episode
from areal_libra.workflows.tools import get_calculator_pool

logger = logging.getLogger("areal_libra.math_tool")

DEFAULT_REWARD = "areal_libra.workflows.reward.dapo_math_reward"

# The reward function's positional parameters: dataset columns of these names must not be passed again.
_REWARD_POSITIONAL = ("prompt", "completions", "prompt_ids", "completion_ids")

def _prompt_id(data: dict[str, Any]) -> str:
    if data.get("prompt_id") is not None:
        return str(data["prompt_id"])
    # Stable across steps for the same prompt, as the trace format asks.
    return "p-" + hashlib.sha1(repr(data.get("messages")).encode()).hexdigest()[:12]


class MathToolWorkflow(RolloutWorkflow):
    """The episode loop; subclasses for other tools override close_tag, extract, make_tool, call_tool and
    compute_reward (e.g. code_sandbox.CodeSandboxWorkflow)."""

    close_tag = CALC_CLOSE

    def __init__(
        self,
        gconfig: GenerationHyperparameters,
        tokenizer: Any = None,
        tokenizer_path: str | None = None,
        reward_fn: Callable[..., float] | str = DEFAULT_REWARD,
        max_turns: int = 3,
        tool_timeout_s: float = 1.0,
        tool_workers: int = 2,
    ):
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if tokenizer is None and tokenizer_path is None:
            raise ValueError("MathToolWorkflow needs tokenizer or tokenizer_path")
        if tokenizer is None or isinstance(tokenizer, str):
            tokenizer = load_hf_tokenizer(str(tokenizer or tokenizer_path))
        self.tokenizer = tokenizer
        self.max_turns = max_turns
        gconfig = gconfig.new_with_stop_and_pad_token_ids(tokenizer)
        close_ids = tokenizer.encode(self.close_tag, add_special_tokens=False)
        if len(close_ids) == 1:  # a dedicated token: stop on its id
            self.calc_close_id: int | None = close_ids[0]
            gconfig = gconfig.new(stop_token_ids=gconfig.stop_token_ids + [close_ids[0]])
        else:  # a general tokenizer (e.g. Qwen): stop on the string
            self.calc_close_id = None
            gconfig = gconfig.new(stop=list(gconfig.stop or []) + [self.close_tag])
        self.gconfig = gconfig.new(n_samples=1)
        if isinstance(reward_fn, str):
            reward_fn = import_from_string(reward_fn)
        self.async_reward_fn = AsyncRewardWrapper(reward_fn)
        self.tool = self.make_tool(tool_workers, tool_timeout_s)
        self.tool.start()  # before the reward process pool forks its workers

    def make_tool(self, workers: int, timeout_s: float) -> Any:
        """The process-wide tool pool (its `name` is the trace's tool name)."""
        return get_calculator_pool(size=workers, timeout_s=timeout_s)

    def extract(self, text: str) -> str | None:
        """The tool call that a turn's text ends with, or None."""
        return extract_call(text)

    async def call_tool(self, call: str, data: dict[str, Any]) -> tuple[str, str, float]:
        """(status, the text appended to the context, latency in s) of one tool call."""
        result = await self.tool.acall(call)
        return result.status, format_result(result.payload), result.latency_s

    async def compute_reward(self, prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int],
                             data: dict[str, Any]) -> float:
        extra = {k: v for k, v in data.items() if k not in _REWARD_POSITIONAL}
        return float(await self.async_reward_fn(prompt, completion, prompt_ids, completion_ids, **extra))

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> dict[str, torch.Tensor]:
        step = engine.get_version()
        with running(step):  # in flight at its start version (the controller's complete cohorts)
            return await self._episode(engine, data, step)

    async def _episode(self, engine: InferenceEngine, data: dict[str, Any], step: int) -> dict[str, torch.Tensor]:
        tok = self.tokenizer
        prompt_ids = apply_chat_template(tok, data["messages"], tokenize=True, add_generation_prompt=True)
        prompt_id = _prompt_id(data)
        traj_id = f"{prompt_id}-{uuid.uuid4().hex[:10]}"
        ep = Episode()
        ep.add_context(prompt_ids)
        segments: list[Segment] = []
        tool_meta: list[dict[str, Any]] = []
        completion = ""
        model_tokens = 0
        finish = "stop"
        for turn in range(self.max_turns):
            budget = min(self.gconfig.max_new_tokens, self.gconfig.max_tokens - len(ep.seq))
            if budget <= 0:
                finish = "length"
                break
            req = ModelRequest(
                rid=uuid.uuid4().hex,  # a new request per turn: the dispatcher may place each one anew
                input_ids=list(ep.seq),
                gconfig=self.gconfig.new(max_new_tokens=budget),
                tokenizer=tok,
                metadata={
                    "trajectory_id": traj_id,
                    "prompt_id": prompt_id,
                    "turn": turn,
                    "prompt_tokens": len(prompt_ids),
                    "context_tokens": len(ep.seq),
                    "model_tokens": model_tokens,
                    "tool_returns": [dict(t) for t in tool_meta],
                },
            )
            resp = await engine.agenerate(req)
            out = ep.add_output(resp)
            model_tokens += len(out)
            text = tok.decode(out, skip_special_tokens=True)
            completion += text
            finish = {"tool_calls": "stop"}.get(resp.stop_reason, resp.stop_reason)
            expr = self.extract(text) if resp.stop_reason != "abort" else None
            if self.calc_close_id is not None and (not out or out[-1] != self.calc_close_id):
                expr = None  # the tag must be the stop token itself, not text the model spelled out
            if expr is None:
                segments.append(Segment(len(out), None))
                break
            if turn == self.max_turns - 1:  # a call with no turn left to use its result
                segments.append(Segment(len(out), None))
                finish = "length"
                break
            status, result_text, latency_s = await self.call_tool(expr, data)
            payload = tok.encode(result_text, add_special_tokens=False)
            ep.add_context(payload)
            completion += result_text
            ret = ToolReturn(self.tool.name, len(payload), status, round(latency_s, 6))
            segments.append(Segment(len(out), ret))
            tool_meta.append({"name": ret.name, "payload_tokens": ret.payload_tokens, "status": ret.status})
        if not segments:  # the prompt alone filled max_tokens
            segments.append(Segment(0, None))

        reward = await self.compute_reward(tok.decode(prompt_ids), completion, prompt_ids, ep.seq[len(prompt_ids):], data)
        tools = [s.tool for s in segments if s.tool is not None]
        stats_tracker.get(workflow_context.stat_scope()).scalar(
            reward=reward,
            num_turns=len(segments),
            tool_calls=len(tools),
            tool_failures=sum(t.status == "failure" for t in tools),
            tool_timeouts=sum(t.status == "timeout" for t in tools),
            gen_tokens=model_tokens,
        )
        emit(Trajectory(
            trajectory_id=traj_id,
            prompt_id=prompt_id,
            step=step,
            prompt_tokens=len(prompt_ids),
            segments=tuple(segments),
            finish_reason=finish if finish in ("stop", "length", "abort") else None,
            reward=reward,
            extra={"completion": completion, "answer": data.get("answer")},
        ))
        return ep.tensors(reward)
