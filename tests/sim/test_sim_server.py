"""Iteration-level server model: closed-form chunks agree with a per-iteration reference loop."""

import random

from areal_libra.sim.hardware import truth_for
from areal_libra.sim.server import RolloutServer, SimRequest
from areal_libra.trace import Segment, ToolReturn, Trajectory
from evaluation.sim_bench import replay_on_server


def _trace(n=6, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        segs = []
        turns = rng.randint(1, 4)
        for k in range(turns):
            tool = None if k == turns - 1 else ToolReturn("bash", rng.randint(0, 300), "success", 0.5)
            segs.append(Segment(rng.randint(1, 120), tool))
        out.append(Trajectory(f"t{i}", f"p{i}", 0, rng.randint(10, 500), tuple(segs)))
    return out


def _reference(truth, tp, trajs, concurrency):
    """Plain per-iteration loop: FIFO admission at iteration boundaries, prefill before the iteration,
    one token per running request per iteration, tool returns (zero latency) rejoin at the next boundary."""
    todo = list(trajs)
    queue = []  # (traj, seg, context, prefill_new, prefill_prior)
    running = []  # [traj, seg, context, remaining]
    t = 0.0
    in_flight = 0
    while todo or queue or running:
        while todo and in_flight < concurrency:
            tr = todo.pop(0)
            queue.append((tr, 0, tr.prompt_tokens, tr.prompt_tokens, 0))
            in_flight += 1
        for tr, seg, ctx, new, prior in queue:
            t += truth.prefill_s(tp, new, prior)
            running.append([tr, seg, ctx, tr.segments[seg].gen_tokens])
        queue = []
        kv = sum(r[2] for r in running)
        t += truth.decode_iteration_s(tp, len(running), kv)
        still = []
        for r in running:
            r[2] += 1
            r[3] -= 1
            if r[3] > 0:
                still.append(r)
                continue
            tr, seg, ctx = r[0], r[1], r[2]
            tool = tr.segments[seg].tool
            if tool is None:
                in_flight -= 1
            else:
                queue.append((tr, seg + 1, ctx + tool.payload_tokens, tool.payload_tokens, ctx))
        running = still
    return t


def test_serial_replay_with_zero_tool_latency_is_the_sum_of_its_work():
    truth = truth_for("a800", "qwen3-14b")
    trajs = _trace()
    run = replay_on_server(truth, 2, trajs, tool_latency_scale=0.0, concurrency=1, noise=False)
    expect = 0.0
    for tr in trajs:  # one request at a time: prefill, then gen_tokens iterations at batch 1
        ctx = tr.prompt_tokens
        expect += truth.prefill_s(2, ctx, 0)
        for s in tr.segments:
            for _ in range(s.gen_tokens):
                expect += truth.decode_iteration_s(2, 1, ctx)
                ctx += 1
            if s.tool is not None:
                expect += truth.prefill_s(2, s.tool.payload_tokens, ctx)
                ctx += s.tool.payload_tokens
    assert abs(run.seconds - expect) <= 1e-9 * expect
    assert run.gen_tokens == sum(t.model_tokens for t in trajs)
    assert abs(run.busy_s - run.seconds) <= 1e-9 * run.seconds  # never idle without tool latency


def test_continuous_batching_matches_per_iteration_reference():
    truth = truth_for("a800", "qwen3-14b")
    trajs = _trace(n=12, seed=3)
    for conc in (3, 12):
        run = replay_on_server(truth, 1, trajs, tool_latency_scale=0.0, concurrency=conc, noise=False)
        ref = _reference(truth, 1, trajs, conc)
        assert abs(run.seconds - ref) <= 1e-6 * ref, (conc, run.seconds, ref)
        assert run.gen_tokens == sum(t.model_tokens for t in trajs)
        assert run.prefill_tokens == sum(t.prompt_tokens + sum(s.tool.payload_tokens for s in t.segments if s.tool)
                                         for t in trajs)


def test_kv_pool_full_preempts_and_loses_no_tokens():
    truth = truth_for("a800", "qwen3-14b")
    trajs = [Trajectory(f"t{i}", "p", 0, 4000, (Segment(3000, None),)) for i in range(40)]
    roomy = replay_on_server(truth, 8, trajs, noise=False)
    tight = replay_on_server(truth, 1, trajs, noise=False, mem_fraction=0.52)
    assert roomy.preemptions == 0
    assert tight.preemptions > 0
    assert tight.gen_tokens == roomy.gen_tokens == 40 * 3000
    assert tight.prefill_tokens > roomy.prefill_tokens  # preempted requests recompute their context


def test_tool_latency_leaves_the_batch_idle():
    truth = truth_for("a800", "qwen3-14b")
    trajs = _trace(n=4, seed=1)
    fast = replay_on_server(truth, 1, trajs, tool_latency_scale=0.0, noise=False)
    slow = replay_on_server(truth, 1, trajs, tool_latency_scale=20.0, noise=False)
    assert slow.seconds > fast.seconds
    assert slow.busy_s < slow.seconds
    assert slow.gen_tokens == fast.gen_tokens


def test_interrupt_before_a_paused_chunk_starts_runs_nothing():
    # A weight sync pauses the server; an arrival during a long pause interrupts a chunk that has not begun
    # (a large batch makes the closed-form inversion's discriminant negative there).
    truth = truth_for("a800", "qwen3-14b")
    s = RolloutServer(0, 1, 0, truth, random.Random(0))
    for i in range(256):
        s.enqueue(SimRequest(Trajectory(f"a{i}", "a", 0, 200, (Segment(500, None),)), None, 0, 0.0), 0, 200)
    s.start_chunk(0.0)
    s.pause(0.0, 300.0, flush=False)
    start, _ = s.start_chunk(0.0)
    assert start > 300.0
    it = s.it
    assert s.interrupt(1.0) == [] and s.it == it and s.chunk is None
