"""Elastic Hybrid Pool workers taken from the plan's training replicas: the core keeps more than half."""

import pytest

from areal_libra.sim.cluster import Layout, TrainLayout
from areal_libra.sim.libra import hybrid_from_train


@pytest.mark.parametrize("dp,expect", [(1, 0), (2, 0), (3, 1), (4, 1), (5, 2), (8, 3)])
def test_elastic_workers_never_take_half_the_trainer(dp, expect):
    lay = Layout(TrainLayout(2, 2, dp), [(1, 0)] * 10 + [(2, 1)] * 4, [4000, 30000])
    core, units = hybrid_from_train(lay, max_units=3)
    assert core is lay
    assert len(units) == expect
    for u in units:
        assert u.training  # they start as training replicas
        assert sum(tp for tp, _ in u.specs) == 4  # one replica's GPUs (tp*pp) as rollout servers
        assert {b for _, b in u.specs} == {0}  # the bucket holding the most rollout GPUs
