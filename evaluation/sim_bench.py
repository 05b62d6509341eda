"""Single-server runs of the hardware truth: decode benchmarks and trace replays (used by the tests and
to calibrate the truth model against public benchmarks)."""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence
from dataclasses import dataclass

from areal_libra.sim.hardware import HardwareTruth
from areal_libra.sim.server import RolloutServer, SimRequest
from areal_libra.trace import Segment, Trajectory


@dataclass
class ServerRun:
    seconds: float
    gen_tokens: int
    prefill_tokens: int
    busy_s: float
    preemptions: int

    @property
    def decode_tokens_per_s(self) -> float:
        return self.gen_tokens / self.seconds if self.seconds > 0 else 0.0


def replay_on_server(truth: HardwareTruth, tp: int, trajs: Sequence[Trajectory], tool_latency_scale: float = 1.0,
                     concurrency: int | None = None, seed: int = 0, noise: bool = True,
                     mem_fraction: float | None = None) -> ServerRun:
    """Run `trajs` on one TP-`tp` server, at most `concurrency` trajectories in flight (all by default)."""
    rng = random.Random(seed)
    s = RolloutServer(0, tp, 0, truth, rng, mem_fraction, max_running=1 << 20)
    if not noise:
        s.speed, s.sigma = 1.0, 0.0
    todo = list(trajs)
    todo.reverse()
    limit = concurrency or len(todo)
    events: list = []
    seq = 0
    in_flight = 0
    gen = 0
    t = 0.0

    def start_more(now: float) -> None:
        nonlocal in_flight
        while todo and in_flight < limit:
            tr = todo.pop()
            s.enqueue(SimRequest(tr, None, 0, now), 0, tr.prompt_tokens)
            in_flight += 1

    def kick(now: float) -> None:
        nonlocal seq
        if s.chunk is not None:
            handle(s.interrupt(now))
        if s.chunk is None:
            r = s.start_chunk(now)
            if r is not None:
                seq += 1
                heapq.heappush(events, (r[0], seq, "chunk", r[1]))

    def handle(done: list[SimRequest]) -> None:
        nonlocal seq, in_flight, gen
        for req in done:
            seg = req.traj.segments[req.seg]
            gen += seg.gen_tokens
            req.done_tokens = 0
            req.ctx += seg.gen_tokens
            if seg.tool is not None:
                s.park(req, req.ctx)
                seq += 1
                heapq.heappush(events, (s.clock + seg.tool.latency_s * tool_latency_scale, seq, "tool", req))
            else:
                in_flight -= 1
                start_more(s.clock)

    start_more(0.0)
    kick(0.0)
    while events:
        t, _, kind, obj = heapq.heappop(events)
        if kind == "chunk":
            if obj != s.epoch:
                continue
            handle(s.finish_chunk())
            kick(t)
        else:
            req = obj
            pay = req.traj.segments[req.seg].tool.payload_tokens
            req.seg += 1
            req.ctx += pay
            s.enqueue(req, req.ctx - pay, pay)
            kick(t)
    end = max(t, s.clock)
    return ServerRun(end, gen, s.prefill_tokens, s.busy_s, s.preemptions)


def decode_benchmark(truth: HardwareTruth, tp: int, n_prompts: int = 320, output_tokens: int = 2000,
                     prompt_tokens: int = 256, seed: int = 0) -> ServerRun:
    """The public vLLM throughput benchmark's shape: fixed concurrency, n prompts x fixed output length."""
    trajs = [Trajectory(f"b{i}", f"b{i}", 0, prompt_tokens, (Segment(output_tokens, None),)) for i in range(n_prompts)]
    return replay_on_server(truth, tp, trajs, seed=seed)


def main() -> None:
    """python -m evaluation.sim_bench: the simulated decode benchmark next to the public TP table."""
    from areal_libra.sim.hardware import VLLM_2023, truth_for

    ref = {1: 1591, 2: 1862, 4: 2228, 8: 2381}  # public vLLM decode benchmark, Mistral-7B on A100
    truth = truth_for("a100", "mistral-7b", VLLM_2023)
    for tp, want in ref.items():
        got = decode_benchmark(truth, tp).decode_tokens_per_s
        print(f"TP{tp}: simulated {got:.0f} tokens/s, public table {want} ({got / want - 1:+.0%})")


if __name__ == "__main__":
    main()
