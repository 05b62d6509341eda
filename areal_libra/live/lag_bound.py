"""Libra's bounded version lag in the live trainer: AReaL's executor consumes by the simulator's rule.

AReaL 1.0.4's `BatchTaskDispatcher.wait_results` hands the trainer the first finished groups; its staleness
manager bounds only how many groups have *started* ((version + eta + 1) x batch), so a group held back by a
long member is trained later, more than eta versions after it started. Patch 14 (patches/areal-1.0.4/
14-consumption-rule.patch) gives the dispatcher a `consume_rule` hook and records each task's start version;
`install` sets the hook to `cmlfq.aging.select_batch`, the rule the simulator's trainer runs
(sim/cluster.py `_try_train` under `RunConfig.strict_staleness`): wait only while a group that started at
version <= k - eta is running, take those groups, fill the batch with the oldest finished ones.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from areal_libra.cmlfq.aging import select_batch

log = logging.getLogger(__name__)


class NotPatched(RuntimeError):
    """AReaL's executor lacks the hook a Libra feature installs (patch 14's consumption rule, patch 17's
    admission gate): the patch is not applied."""


def consume_rule(eta: int) -> Callable[[Sequence[tuple[int, int, bool]], int, int], list[int] | None]:
    """The executor's rule for bound eta: the task ids of the batch for trainer version `version`, or None
    (keep waiting). Live the batch stays at `count` (AReaL's trainer and its prepare_batch expect exactly
    that many): more than a batch of groups at the bound happens only when rejected rollouts let admission
    pass the cap, and the rest are then the first of the next batch."""
    if eta < 0:
        raise ValueError(f"eta must be >= 0, got {eta}")

    def rule(tasks: Sequence[tuple[int, int, bool]], version: int, count: int) -> list[int] | None:
        batch, _ = select_batch(tasks, version, eta, count)
        return None if batch is None else batch[:count]

    return rule


def dispatcher_of(rollout: Any) -> tuple[Any, int] | None:
    """AReaL's BatchTaskDispatcher behind a trainer's rollout engine and its eta (RemoteSGLangEngine wraps the
    RemoteInfEngine, whose workflow_executor owns the dispatcher once initialized); None where the trainer
    has no local executor (AReaL's single-controller mode runs the workflows in rollout workers)."""
    inner = getattr(rollout, "_engine", rollout)
    executor = getattr(inner, "workflow_executor", None)
    if executor is None:
        return None
    return executor.dispatcher, int(executor.max_staleness)


def install(rollout: Any) -> int | None:
    """Install the bounded-lag consumption rule on the trainer's executor; returns eta, or None (logged)
    where there is no local executor. NotPatched (one line: what to run) when AReaL lacks patch 14."""
    found = dispatcher_of(rollout)
    if found is None:
        log.warning("libra.bound_lag: no local workflow executor; the version lag is not bounded at consumption")
        return None
    dispatcher, eta = found
    if not hasattr(dispatcher, "consume_rule"):
        raise NotPatched("libra.bound_lag needs AReaL patch 14 (consumption rule): run "
                         "`python -m areal_libra.patches apply`")
    dispatcher.consume_rule = consume_rule(eta)
    return eta
