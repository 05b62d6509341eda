"""SearchR1Workflow: Search-R1's multi-turn retrieval episode for AReaL's rollout loop.

The model writes `<search>QUERY</search>` (generation stops there); the retrieval server's top-k passages
are appended as `<information>...</information>` tokens (loss-masked, logprob 0, version -1) and a new
request continues; the episode ends with `<answer>...</answer>` and EOS, a turn without a search,
`max_turns` or `gconfig.max_tokens`. Reward: exact match of the last answer. The episode loop, the
routing metadata (C-MLFQ states keyed by the tool's name, `search`) and the canonical Trajectory sent to
the trajectory sink are MathToolWorkflow's; only the tool, its markup and the reward differ."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from areal.api.cli_args import GenerationHyperparameters

from areal_libra.workflows.math_tool import MathToolWorkflow
from areal_libra.workflows.retriever import RetrieverClient
from areal_libra.workflows.search_markup import SEARCH_CLOSE, extract_query, format_information
from areal_libra.workflows.sink import set_trajectory_sink  # noqa: F401 - re-exported for the sink lookup

DEFAULT_REWARD = "areal_libra.workflows.search_markup.exact_match_reward"


class SearchR1Workflow(MathToolWorkflow):
    close_tag = SEARCH_CLOSE

    def __init__(
        self,
        gconfig: GenerationHyperparameters,
        retriever_url: str,
        tokenizer: Any = None,
        tokenizer_path: str | None = None,
        reward_fn: Callable[..., float] | str = DEFAULT_REWARD,
        max_turns: int = 3,
        topk: int = 2,
        tool_timeout_s: float = 5.0,
    ):
        if not retriever_url or retriever_url == "local":
            raise ValueError(f"SearchR1Workflow needs the retrieval server's URL, got {retriever_url!r}")
        self.retriever_url, self.topk = retriever_url, topk
        super().__init__(gconfig, tokenizer=tokenizer, tokenizer_path=tokenizer_path, reward_fn=reward_fn,
                         max_turns=max_turns, tool_timeout_s=tool_timeout_s)

    def make_tool(self, workers: int, timeout_s: float) -> RetrieverClient:
        return RetrieverClient(self.retriever_url, topk=self.topk, timeout_s=timeout_s)

    def extract(self, text: str) -> str | None:
        return extract_query(text)

    async def call_tool(self, call: str, data: dict[str, Any]) -> tuple[str, str, float]:
        result = await self.tool.acall(call)
        return result.status, format_information(result.payload), result.latency_s

    @classmethod
    def libra_kwargs(cls, libra: Any) -> dict[str, Any]:
        """Constructor arguments from the run's `libra:` config (the trainer adds them to AReaL's)."""
        tools = libra.tools
        return {"retriever_url": str(tools.retriever_url), "topk": int(tools.retriever_topk),
                "tool_timeout_s": float(tools.retriever_timeout_s)}
