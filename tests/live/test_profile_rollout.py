"""The live profiling pass fits AReaL's staleness budget (live.train.profile_rollout): a pass of more groups than
the executor admits before a version bump used to wait forever for capacity no training step would free."""

from __future__ import annotations

import pytest
from areal.infra.staleness_manager import StalenessManager

from areal_libra.live.train import profile_rollout


class _Version:
    def get_version(self) -> int:
        return 0


class _Rollout:
    """rollout_batch as AReaL's executor admits it: a group is submitted only while the staleness manager has
    capacity, and a batch returns once all of its groups were accepted; a group that can never be submitted (no
    training step runs during the pass) is the hang, raised here instead of waited on."""

    def __init__(self, sm: StalenessManager) -> None:
        self.sm, self.batches = sm, []

    def rollout_batch(self, rows, **kwargs):
        self.batches.append(list(rows))
        for _ in rows:
            if self.sm.get_capacity() <= 0:
                raise RuntimeError("no capacity: the executor would wait forever")
            self.sm.on_rollout_enqueued()
            self.sm.on_rollout_submitted()
        for _ in rows:
            self.sm.on_rollout_accepted()


@pytest.mark.parametrize("groups, staleness, batch", [(16, 1, 4), (5, 0, 4), (8, 1, 4)])
def test_a_profiling_pass_runs_in_chunks_the_staleness_budget_admits(groups, staleness, batch):
    sm = StalenessManager(_Version(), max_concurrent_rollouts=256, consumer_batch_size=batch, max_staleness=staleness)
    rollout = _Rollout(sm)
    rows = list(range(groups))
    profile_rollout(rollout, rows, sm, 0, group_size=2)
    assert [r for b in rollout.batches for r in b] == rows  # every group played once, in order
    assert max(len(b) for b in rollout.batches) <= (staleness + 1) * batch
    assert sm.get_capacity() == (staleness + 1) * batch  # the budget left as the pass found it


def test_one_batch_without_a_staleness_manager():
    class _Plain:
        def __init__(self) -> None:
            self.batches = []

        def rollout_batch(self, rows, **kwargs):
            self.batches.append(list(rows))

    r = _Plain()
    profile_rollout(r, list(range(16)), None, 0)
    assert r.batches == [list(range(16))]
