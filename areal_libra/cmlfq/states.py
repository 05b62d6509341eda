"""Tool-return states: the key material of the causal prefix tree (docs/cmlfq.md).

A state is (tool type, payload size class, status). Size classes are configurable thresholds on the
payload tokens the return appended to the context (public Libra defaults: small <= 500 < medium <= 5000 <
large).
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_libra.trace import TOOL_STATUSES, ToolReturn

SIZE_NAMES = ("small", "medium", "large")


@dataclass(frozen=True)
class SizeClasses:
    """Ascending payload thresholds: class i holds payloads <= thresholds[i]; above the last -> last+1."""

    small: int = 500
    medium: int = 5000

    def __post_init__(self) -> None:
        if self.small < 0 or self.medium < self.small:
            raise ValueError(f"size thresholds must satisfy 0 <= small <= medium, got {self.small}, {self.medium}")

    def classify(self, payload_tokens: int) -> str:
        if payload_tokens <= self.small:
            return "small"
        if payload_tokens <= self.medium:
            return "medium"
        return "large"


@dataclass(frozen=True)
class ToolState:
    tool: str
    size_class: str
    status: str


def tool_state(tool: ToolReturn | dict, sizes: SizeClasses = SizeClasses()) -> ToolState:
    """Map one tool return (object or {name, payload_tokens, status} dict) to its tree state."""
    if isinstance(tool, dict):
        name = str(tool.get("name", "tool"))
        payload = int(tool.get("payload_tokens", 0))
        status = str(tool.get("status", "success"))
    else:
        name, payload, status = tool.name, tool.payload_tokens, tool.status
    # Anything that is not a clean success behaves like a failure for the causal structure (retries).
    if status not in TOOL_STATUSES:
        status = "failure"
    return ToolState(name, sizes.classify(payload), status)


def as_tool_return(tool: ToolReturn | dict) -> ToolReturn:
    if isinstance(tool, ToolReturn):
        return tool
    return ToolReturn(
        name=str(tool.get("name", "tool")),
        payload_tokens=int(tool.get("payload_tokens", 0)),
        status=str(tool.get("status", "success")),
        latency_s=float(tool.get("latency_s", 0.0) or 0.0),
    )


@dataclass(frozen=True)
class RequestInfo:
    trajectory_id: str
    prompt_id: str
    prompt_tokens: int
    context_tokens: int
    model_tokens: int
    tool_returns: tuple[ToolReturn, ...]
    step: int = 0
    final_length: int | None = None  # known only to the oracle's callers (replay, simulator)
    # Context at the start and after each tool return so far (len(tool_returns) + 1 entries, the last one
    # = context_tokens) when the caller tracked it; lets C-MLFQ read a shallower tree node correctly.
    decision_contexts: tuple[int, ...] = ()
