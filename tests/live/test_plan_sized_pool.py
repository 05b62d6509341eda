"""The Elastic Hybrid Pool sized with the plan (libra.elastic.size_with_plan, on by default in libra mode on
cluster=emulated_host): the sizing rule shared with the simulator, the config default, the emulated trainer's
accelerators with the pool inside the plan, and a released hybrid's server inside a real emulated host."""

from __future__ import annotations

import urllib.request

import pytest

from areal_libra.config import compose, libra_config
from areal_libra.elastic.policy import hybrid_count, hybrid_server_tp
from areal_libra.live.elastic_worker import AfterFirstJoin, emulated_launch
from areal_libra.rollout.emulated_host import launch_host
from areal_libra.rollout.emulation import ClusterEmulation
from areal_libra.rollout.groups import RolloutGroup
from areal_libra.sim.cluster import Layout, TrainLayout
from areal_libra.sim.libra import hybrid_from_train


@pytest.mark.parametrize("dp,tp,pp,servers", [(7, 1, 1, [(4, 0), (4, 0)]), (44, 1, 1, [(4, 0)] * 5),
                                              (4, 2, 1, [(1, 0), (8, 1)]), (2, 1, 2, [(2, 0)]),
                                              (9, 2, 2, [(1, 0), (1, 0), (2, 1)])])
def test_the_simulator_sizes_its_pool_by_the_shared_rule(dp: int, tp: int, pp: int, servers: list) -> None:
    layout = Layout(TrainLayout(tp, pp, dp, 0), servers, [1000, 4000])
    _, units = hybrid_from_train(layout, 3, 2)
    assert len(units) == hybrid_count(dp, 3) == min(3, (dp - 1) // 2)
    for u in units:
        assert u.training and sum(t for t, _ in u.specs) == tp * pp
        assert u.specs[0][0] == hybrid_server_tp(tp * pp, max(t for t, _ in servers))


def test_on_by_default_in_libra_mode_on_the_emulated_host_and_off_in_static() -> None:
    base = ["experiment=emulated", "cluster=emulated_host"]
    libra = libra_config(compose(base).libra)
    assert libra.elastic.enabled and libra.elastic.size_with_plan and libra.elastic.hybrids == 3
    assert not libra.elastic.rollout_clock  # T_rollout by the simulator's rule (wait and backlog)
    assert libra_config(compose(["experiment=emulated", "cluster=emulated"]).libra).elastic.rollout_clock
    assert not libra_config(compose([*base, "libra.mode=static"]).libra).elastic.enabled
    # Explicitly asked in static mode (a pool not sized with the plan): still refused.
    with pytest.raises(Exception, match="needs libra.mode=libra"):
        libra_config(compose(["experiment=emulated", "cluster=emulated_host", "libra.mode=static",
                              "libra.elastic.size_with_plan=false"]).libra)
    # The emulation takes no accelerators outside the plan for a pool sized with it.
    assert ClusterEmulation.from_libra(libra).hybrid_accelerators == 0


def test_the_trainer_counts_the_pool_inside_the_plan() -> None:
    emu = ClusterEmulation(accelerators=16, time_scale=1.0)
    groups = [RolloutGroup("a", 1, 1), RolloutGroup("b", 4, 2)]  # 9 rollout: the plan trains on 7
    assert emu.trainer_now(groups, 0) == 7  # no pool yet
    emu.set_plan_pool(3, 1)
    assert [emu.trainer_now(groups, t) for t in (0, 1, 2, 3)] == [4, 5, 6, 7]
    # A pool of fixed size outside the plan adds one accelerator per training hybrid.
    out = ClusterEmulation(accelerators=16, time_scale=1.0, hybrid_accelerators=2)
    assert [out.trainer_now(groups, t) for t in (0, 2)] == [5, 7]


def test_a_released_hybrid_serves_inside_the_emulated_host(tmp_path) -> None:
    backend, proc = launch_host("qwen3-14b", "h200", 1.0, tmp_path)
    try:
        rollout = AfterFirstJoin(_Recorder(emulated_launch(backend, 2, 32, "h0")))
        rollout.start(None)  # the worker's first start: it starts in training, nothing serves
        assert rollout.inner.urls == [] and backend.pacing()["servers"] == 0
        rollout.start(None)  # released: one TP2 emulated server in the host
        (url,) = rollout.inner.urls
        with urllib.request.urlopen(url + "/get_server_info", timeout=10) as r:
            assert b'"tp_size": 2' in r.read()
        assert backend.pacing()["servers"] == 1
        rollout.inner.stops[0]()
        assert backend.pacing()["servers"] == 0
    finally:
        proc.terminate()
        proc.wait(timeout=10)


class _Recorder:
    def __init__(self, launch) -> None:
        self.launch, self.urls, self.stops = launch, [], []

    def start(self, replica) -> None:
        url, stop = self.launch(replica)
        self.urls.append(url)
        self.stops.append(stop)

    def drain(self) -> list:
        return []


def test_a_wait_with_groups_left_over_is_not_rollout_behind() -> None:
    # Without the idle clock (the emulated host measures as the simulator): a trainer that waited 3 s for its
    # batch while 170 finished groups were left beyond it spent the wait on its own work (taking and collating
    # the batch), so rollout is ahead (the backlog rule); with none left over, rollout was behind by the wait.
    from areal_libra.control import StepObservation
    from areal_libra.live.live_cluster import observation

    rec = {"step_time_s": 28.0, "timeperf/train_step": 20.0, "timeperf/update_weights": 3.0}
    measured = StepObservation(step=5, interval_s=28.0, train_s=20.0, rollout_s=23.0)
    ahead = observation(5, rec, measured=measured, inputs={"wait_s": 3.0, "backlog": 170, "batch": 64})
    behind = observation(5, rec, measured=measured, inputs={"wait_s": 3.0, "backlog": 0, "batch": 64})
    assert ahead.train_s == 23.0 and ahead.rollout_s == 0.5 * 23.0
    assert behind.rollout_s == 23.0 + 3.0
