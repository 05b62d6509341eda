"""A parametric agentic workload for regime studies: every knob the regime map sweeps is one field.

Generated tokens per trajectory are log-normal with a chosen P99/median ("tail"); half of the log-variance
is per prompt (shared by its GRPO group, as a hard prompt makes all its samples long) and half per sample.
A trajectory's generation is split into turns of about `tokens_per_turn`; every turn but the last ends in a
tool call with a log-normal payload and latency. Lengths grow by `drift` over `horizon` steps
(WorkloadConfig) and are cut at `max_len` (finish_reason 'length')."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from areal_libra.sim.workloads import Workload, WorkloadConfig
from areal_libra.trace import Segment, ToolReturn, Trajectory

Z99 = 2.3263  # standard normal 99th percentile


@dataclass(frozen=True)
class SynthParams:
    median_tokens: float = 4000.0  # median generated tokens per trajectory at step 0
    tail: float = 4.0  # P99 / median of generated tokens at step 0 (before the cap)
    tokens_per_turn: float = 1500.0  # a few long turns (Search-R1-like); simulation cost grows with turns
    max_turns: int = 20
    prompt_tokens: float = 800.0  # median prompt
    payload_tokens: float = 300.0  # median tool payload
    tool_s: float = 2.0  # median tool latency per call (0: tools return at once)

    def check(self) -> None:
        if self.median_tokens < 1 or self.tokens_per_turn < 1 or self.prompt_tokens < 1:
            raise ValueError("median_tokens, tokens_per_turn and prompt_tokens must be >= 1")
        if self.tail < 1.0:
            raise ValueError(f"tail (P99/median) must be >= 1, got {self.tail}")
        if self.tool_s < 0 or self.payload_tokens < 0 or self.max_turns < 1:
            raise ValueError("tool_s and payload_tokens must be >= 0 and max_turns >= 1")


class SyntheticAgentic(Workload):
    name = "synthetic"

    def __init__(self, cfg: WorkloadConfig, params: SynthParams | None = None):
        super().__init__(cfg)
        self.p = params or SynthParams()
        self.p.check()
        sigma = math.log(self.p.tail) / Z99
        self.sigma_prompt = self.sigma_sample = sigma / math.sqrt(2.0)

    def sample_group(self, version: int, rng: random.Random) -> list[Trajectory]:
        p = self.p
        pid = f"syn-{rng.randrange(1 << 30)}"
        prompt = max(16, int(rng.lognormvariate(math.log(p.prompt_tokens), 0.3)))
        hard = rng.gauss(0.0, self.sigma_prompt)
        grow = (1.0 + self.cfg.drift * self.progress(version)) * self.cfg.length_scale
        out = []
        for _ in range(self.cfg.group_size):
            total = max(8.0, p.median_tokens * grow * math.exp(hard + rng.gauss(0.0, self.sigma_sample)))
            turns = max(1, min(p.max_turns, round(total / p.tokens_per_turn)))
            per = max(1, int(total / turns))
            segs = []
            gauss = rng.gauss  # exp(gauss) is a log-normal draw; cheaper than lognormvariate in this hot loop
            for _ in range(turns - 1):
                pay = int(p.payload_tokens * math.exp(0.6 * gauss(0.0, 1.0))) if p.payload_tokens > 0 else 0
                lat = p.tool_s * math.exp(0.6 * gauss(0.0, 1.0)) if p.tool_s > 0 else 0.0
                segs.append(Segment(per, ToolReturn("tool", pay, "success", lat)))
            segs.append(Segment(per, None))
            segs_c, fr = self._cap(prompt, segs)
            out.append(Trajectory(self._tid(version, pid), pid, version, prompt, segs_c, fr))
        return out
