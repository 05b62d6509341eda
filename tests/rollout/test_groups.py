"""Rollout groups: allocation strings, config resolution, bucket thresholds, GPU placement, xccl ranks."""

import shutil
import tempfile
import time
from pathlib import Path

import pytest

from areal_libra.rollout.groups import (
    GroupConfigError,
    RolloutGroup,
    assign_buckets,
    format_allocation,
    groups_from_plan,
    parse_allocation,
    place_local,
    ray_bundles,
    resolve_groups,
    server_sizes,
    xccl_rank_offsets,
)
from areal_libra.utils import free_port, pid_alive


def test_parse_and_format_allocation_roundtrip() -> None:
    backend, groups = parse_allocation("sglang:d2t1+d1t2+d1t4")
    assert backend == "sglang"
    assert [(g.tp, g.count) for g in groups] == [(1, 2), (2, 1), (4, 1)]
    assert [g.gpus for g in groups] == [2, 2, 4]
    assert format_allocation(backend, groups) == "sglang:d2t1+d1t2+d1t4"
    # order of terms and of d/t inside a term does not matter; a missing dimension is 1
    _, g2 = parse_allocation("sglang:t4d1+d2+t2")
    assert [(g.tp, g.count) for g in g2] == [(1, 2), (2, 1), (4, 1)]


@pytest.mark.parametrize("bad", ["d2t1", "tpu:d1t1", "sglang:", "sglang:d2x1", "sglang:d0t1", "sglang:d1t1+d2t1",
                                 "sglang:d1d2", "sglang:d1t2p2"])
def test_bad_allocation_strings_are_one_line_errors(bad: str) -> None:
    with pytest.raises(GroupConfigError) as e:
        parse_allocation(bad)
    assert "\n" not in str(e.value) and repr(bad)[1:-1] in str(e.value)


def test_resolve_groups_from_list_and_string() -> None:
    libra = {"rollout_groups": [{"name": "long", "tp": 2, "count": 1, "threads": 2},
                                {"name": "short", "tp": 1, "count": 2}]}
    groups = resolve_groups(libra, max_tokens=160)
    # ascending TP = ascending thresholds; the range is split evenly when thresholds are not given
    assert [(g.name, g.max_len) for g in groups] == [("short", 80), ("long", 160)]
    libra["rollout_alloc"] = "sglang:d1t1+d1t4"
    assert [(g.tp, g.max_len) for g in resolve_groups(libra, 100)] == [(1, 50), (4, 100)]


def test_resolve_groups_rejects_bad_config() -> None:
    with pytest.raises(GroupConfigError, match="unknown key"):
        resolve_groups({"rollout_groups": [{"tp": 1, "gpus": 3}]}, 100)
    with pytest.raises(GroupConfigError, match="positive integer"):
        resolve_groups({"rollout_groups": [{"tp": 0}]}, 100)
    with pytest.raises(GroupConfigError, match="unique"):
        resolve_groups({"rollout_groups": [{"name": "a", "tp": 1}, {"name": "a", "tp": 2}]}, 100)
    with pytest.raises(GroupConfigError, match="ascending"):
        assign_buckets([RolloutGroup("a", 1, max_len=50), RolloutGroup("b", 2, max_len=50)], 100)
    with pytest.raises(GroupConfigError, match="at least one"):
        resolve_groups({"rollout_groups": []}, 100)


def test_explicit_thresholds_order_groups() -> None:
    g = assign_buckets([RolloutGroup("big", 4, max_len=900), RolloutGroup("small", 1, max_len=100)], 1000)
    assert [x.name for x in g] == ["small", "big"]


def test_groups_from_plan() -> None:
    from areal_libra.planner.types import Plan, RolloutInstance, TrainParallel

    train = TrainParallel(**{f: 1 for f in ("tp", "pp", "dp", "ep", "micro_batch")}) \
        if "micro_batch" in TrainParallel.__dataclass_fields__ else None
    if train is None:
        pytest.skip("planner TrainParallel changed")
    plan = Plan(train=train, rollout_gpus=8,
                instances=[RolloutInstance(1, 2, 4000), RolloutInstance(2, 1, 12000), RolloutInstance(4, 1, 32000)],
                t_train_s=1, t_rollout_s=1, makespan_s=1, solve_s=0)
    groups = groups_from_plan(plan)
    assert [(g.tp, g.count, g.max_len) for g in groups] == [(1, 2, 4000), (2, 1, 12000), (4, 1, 32000)]
    assert format_allocation("sglang", groups) == plan.rollout_alloc()


def test_local_placement_is_tp_aligned_and_in_address_order() -> None:
    _, groups = parse_allocation("sglang:d2t1+d1t2+d1t4")
    pl = place_local(groups, n_gpus=8)
    assert [p.tp for p in pl] == [1, 1, 2, 4]
    used = [g for p in pl for g in p.gpus]
    assert sorted(used) == list(range(8))  # no GPU shared, none stranded
    for p in pl:
        assert p.gpus[0] % p.tp == 0 and list(p.gpus) == list(range(p.gpus[0], p.gpus[0] + p.tp))
    assert pl[3].cuda_visible_devices == "0,1,2,3"
    # training takes GPUs 0-3: rollout fits in 4-7 only with a smaller mix
    with pytest.raises(GroupConfigError, match="need 8 GPUs"):
        place_local(groups, n_gpus=8, first_gpu=4)
    _, small = parse_allocation("sglang:d2t1+d1t2")
    assert [p.gpus for p in place_local(small, 8, first_gpu=4)] == [(6,), (7,), (4, 5)]


def test_ray_bundles_and_xccl_offsets_follow_real_sizes() -> None:
    _, groups = parse_allocation("sglang:d2t1+d1t2+d1t4")
    assert ray_bundles(groups, cpus_per_server=2) == [[{"GPU": 1.0, "CPU": 2.0}]] * 2 + [
        [{"GPU": 2.0, "CPU": 2.0}], [{"GPU": 4.0, "CPU": 2.0}]]
    sizes = server_sizes(groups)
    assert sizes == [1, 1, 2, 4]
    assert xccl_rank_offsets(sizes) == ([1, 2, 3, 5], 9)


def test_ray_placement_groups_on_custom_gpu_resources() -> None:
    """Ray with 8 logical GPUs (CPU machine): one STRICT_PACK group per server, the right GPU count each."""
    _placement_groups_on_a_private_instance()


@pytest.mark.slow
def test_private_ray_instance_ignores_a_running_cluster(tmp_path, monkeypatch) -> None:
    """A Ray cluster started earlier on this machine with `ray start` (its ray_current_cluster file in Ray's
    temp folder) must not be joined by code that means a private instance (it would refuse num_gpus)."""
    pytest.importorskip("ray")
    from areal_libra.ray.cluster import LocalRayCluster

    cluster = LocalRayCluster(nodes=1, cpus=1, accel=0, log_dir=str(tmp_path)).start()
    try:
        monkeypatch.setenv("RAY_TMPDIR", cluster.temp_dir)  # where ray.init() looks for the running cluster
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        assert (Path(cluster.temp_dir) / "ray" / "ray_current_cluster").read_text().strip()
        _placement_groups_on_a_private_instance()
    finally:
        pids = cluster.stop()
    assert pids and not [p for p in pids if pid_alive(p)]
    assert not Path(cluster.temp_dir).exists()  # its private temp folder is gone too


def test_private_ray_instance_ignores_a_stale_cluster_file(monkeypatch) -> None:
    """The file a killed cluster leaves behind (its address no longer answers) is ignored as well."""
    pytest.importorskip("ray")
    tmp = Path(tempfile.mkdtemp(prefix="arl-stale-", dir="/tmp"))  # short: Ray's socket paths live under it
    try:
        (tmp / "ray").mkdir()
        (tmp / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{free_port()}")
        monkeypatch.setenv("RAY_TMPDIR", str(tmp))
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        _placement_groups_on_a_private_instance()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _placement_groups_on_a_private_instance() -> None:
    ray = pytest.importorskip("ray")
    from areal_libra.ray.cluster import init_private
    from areal_libra.rollout.groups import create_ray_placement_groups

    init_private(num_cpus=4, num_gpus=8)
    try:
        _, groups = parse_allocation("sglang:d2t1+d1t2+d1t4")
        pgs = create_ray_placement_groups(groups, cpus_per_server=1, timeout_s=60)
        assert [pg.bundle_specs[0]["GPU"] for pg in pgs] == [1, 1, 2, 4]
        # Ray reports available resources asynchronously: wait for the reservation to show (a loaded
        # machine showed 4 of 8 GPUs still "available" right after the groups were ready).
        deadline = time.monotonic() + 30
        while ray.available_resources().get("GPU", 0) != 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ray.available_resources().get("GPU", 0) == 0
        _, too_big = parse_allocation("sglang:d1t8")
        with pytest.raises(GroupConfigError, match="could not place"):
            create_ray_placement_groups(too_big, timeout_s=2)
    finally:
        ray.shutdown()
