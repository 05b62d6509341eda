"""Routing replay and metrics (docs/trace-format.md, "Routing metrics").

Replays evaluated trajectories step by step under the visibility rule: a step's trajectories are routed
without seeing each other's outcomes; only after the whole step is scored do they reach policy.finish()
(then end_step()), so later steps see them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace

from areal_libra.cmlfq.states import RequestInfo
from areal_libra.trace import Trajectory


@dataclass
class RoutingMetrics:
    decision_accuracy: float
    token_accuracy: float
    migrated_token_ratio: float
    migrations_per_trajectory: float
    n_trajectories: int
    n_decisions: int

    def as_dict(self) -> dict:
        return asdict(self)


def decision_points(traj: Trajectory, with_contexts: bool = True) -> list[RequestInfo]:
    """What a policy sees at each decision point of a trajectory: its start, then each tool return."""
    ctx, model, tools, ctxs = traj.prompt_tokens, 0, [], [traj.prompt_tokens]
    out = [RequestInfo(traj.trajectory_id, traj.prompt_id, traj.prompt_tokens, ctx, 0, (), traj.step, None,
                       (ctx,))]
    for seg in traj.segments:
        ctx += seg.gen_tokens
        model += seg.gen_tokens
        if seg.tool is None:
            continue
        ctx += seg.tool.payload_tokens
        tools.append(seg.tool)
        ctxs.append(ctx)
        out.append(RequestInfo(traj.trajectory_id, traj.prompt_id, traj.prompt_tokens, ctx, model, tuple(tools),
                               traj.step, None, tuple(ctxs)))
    return out if with_contexts else [replace(r, decision_contexts=()) for r in out]


@dataclass
class _Acc:
    decisions: int = 0
    correct: int = 0
    tokens: int = 0
    tokens_ok: int = 0
    moved_tokens: int = 0
    final_tokens: int = 0
    moves: int = 0
    trajs: int = 0


def route_trajectory(policy, traj: Trajectory, acc: _Acc, reveal_length: bool,
                     points: list[RequestInfo] | None = None,
                     observe: Callable[[RequestInfo, int | None, int], None] | None = None) -> None:
    """Drive one trajectory through the policy's decision points and score them. `points`: precomputed
    decision_points(traj); observe(req, current, new) sees every decision (current None at the start)."""
    final = traj.final_length
    oracle = policy.bucket_of(final)
    if points is None:
        points = decision_points(traj)
    if reveal_length:
        points = [replace(p, final_length=final) for p in points]
    b = policy.start(points[0])
    if observe is not None:
        observe(points[0], None, b)
    acc.decisions += 1
    acc.correct += b == oracle
    returns = iter(points[1:])  # one decision point per segment that ends in a tool call
    for seg in traj.segments:
        # The segment's generation runs where the last decision put it.
        acc.tokens += seg.gen_tokens
        if b == oracle:
            acc.tokens_ok += seg.gen_tokens
        if seg.tool is None:
            continue
        req = next(returns)
        nb = policy.tool_return(req, b)
        if observe is not None:
            observe(req, b, nb)
        if nb != b:
            acc.moves += 1
            acc.moved_tokens += req.context_tokens
            b = nb
        acc.decisions += 1
        acc.correct += b == oracle
    acc.final_tokens += final
    acc.trajs += 1


def replay(policy, eval_trajs: Iterable[Trajectory]) -> RoutingMetrics:
    by_step: dict[int, list[Trajectory]] = {}
    for t in eval_trajs:
        by_step.setdefault(t.step, []).append(t)
    acc = _Acc()
    reveal = getattr(policy, "name", "") == "oracle"
    for step in sorted(by_step):
        trajs = by_step[step]
        for t in trajs:
            route_trajectory(policy, t, acc, reveal)
        for t in trajs:
            policy.finish(t)
        policy.end_step()
    return RoutingMetrics(
        decision_accuracy=acc.correct / acc.decisions if acc.decisions else 0.0,
        token_accuracy=acc.tokens_ok / acc.tokens if acc.tokens else 0.0,
        migrated_token_ratio=acc.moved_tokens / acc.final_tokens if acc.final_tokens else 0.0,
        migrations_per_trajectory=acc.moves / acc.trajs if acc.trajs else 0.0,
        n_trajectories=acc.trajs,
        n_decisions=acc.decisions,
    )
