"""GPU placement on cluster=gpu (issue 13): trainer and rollout servers on disjoint devices, without a GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from areal_libra import launch
from areal_libra.config import compose
from areal_libra.rollout import launcher
from areal_libra.rollout.launcher import ServerSpec
from areal_libra.rollout.placement import (
    ROLLOUT_DEVICES_ENV,
    PlacementError,
    assign_gpus,
    place_new_servers,
    servers_to_retire,
    visible_devices,
)


def _disjoint(p) -> bool:
    used = [d for grp in (p.trainer, *p.servers) for d in grp]
    return len(used) == len(set(used))


def test_assignment_is_disjoint_and_in_order():
    devs = [str(i) for i in range(8)]
    p = assign_gpus(devs, 1, [1, 2, 4])
    assert p.trainer == ("0",)
    assert p.servers == (("1",), ("2", "3"), ("4", "5", "6", "7"))
    assert _disjoint(p)
    # The launcher's own CUDA_VISIBLE_DEVICES is honoured: ids are the ones it sees.
    p = assign_gpus(visible_devices({"CUDA_VISIBLE_DEVICES": "4, 5,6,7"}, 8), 1, [1, 2])
    assert p.trainer == ("4",) and p.servers == (("5",), ("6", "7"))
    assert visible_devices({}, 3) == ["0", "1", "2"]
    # No trainer (the launcher's own CLI): servers from the first device.
    assert assign_gpus(["0", "1"], 0, [2]).servers == (("0", "1"),)


@pytest.mark.parametrize(("devices", "trainer", "tps", "needs"), [
    (["0"], 1, [1], "needs 2 GPUs (trainer 1 + servers 1) but 1 are visible"),
    ([str(i) for i in range(8)], 1, [1, 1, 2, 4], "needs 9 GPUs"),
    ([], 1, [], "needs 1 GPUs (trainer 1 + servers 0) but 0 are visible (none)"),
])
def test_allocation_that_does_not_fit(devices, trainer, tps, needs):
    with pytest.raises(PlacementError, match=needs.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        assign_gpus(devices, trainer, tps)


def test_bad_allocation_values():
    with pytest.raises(PlacementError):
        assign_gpus(["0", "1"], 1, [0])
    with pytest.raises(PlacementError):
        assign_gpus(["0", "0"], 1, [1])


def test_launch_gives_trainer_and_servers_their_own_devices(tmp_path):
    c = compose(["cluster=gpu", f"cluster.fileroot={tmp_path}", "rollout_alloc=sglang:d2t1+d1t2"])
    p = launch.placement(c, env={}, gpu_count=8)
    assert p.trainer == ("0",) and p.servers == (("1",), ("2",), ("3", "4"))
    env = launch.trainer_env(c, ["a:1", "b:2", "c:3"], p.trainer, p.pool)
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and env["LOCAL_RANK"] == "0"
    # what servers the trainer starts later may take: every device but its own
    assert env[ROLLOUT_DEVICES_ENV] == "1,2,3,4,5,6,7"
    assert launch.placement(compose([f"cluster.fileroot={tmp_path}"]), env={}, gpu_count=8) is None  # cpu
    with pytest.raises(launch.LaunchError, match="needs 5 GPUs"):
        launch.placement(c, env={}, gpu_count=4)


class _Proc:
    pid = 0

    def poll(self):
        return None


def test_sglang_servers_start_on_their_devices(monkeypatch, tmp_path):
    # SGLang cannot run here: capture what the launcher would start (command line and environment).
    started = []
    monkeypatch.setattr(launcher.subprocess, "Popen", lambda cmd, **kw: started.append((cmd, kw["env"])) or _Proc())
    monkeypatch.setattr(launcher, "wait_healthy", lambda handles, timeout: None)
    specs = [ServerSpec(tp=1), ServerSpec(tp=2)]
    p = assign_gpus([str(i) for i in range(4)], 1, [1, 2])
    handles = launcher.launch_servers("/m", specs, str(tmp_path), backend="sglang", env={}, placement=p)
    assert [h.gpu_ids for h in handles] == [("1",), ("2", "3")]
    assert [e["CUDA_VISIBLE_DEVICES"] for _, e in started] == ["1", "2,3"]
    for cmd, _ in started:
        assert cmd[cmd.index("--base-gpu-id") + 1] == "0"  # first of its own visible devices
    # Without a placement (the launcher's CLI): the visible devices from the first, still disjoint.
    started.clear()
    launcher.launch_servers("/m", specs, str(tmp_path), backend="sglang", env={"CUDA_VISIBLE_DEVICES": "2,3,4"})
    assert [e["CUDA_VISIBLE_DEVICES"] for _, e in started] == ["2", "3,4"]
    with pytest.raises(PlacementError, match="needs 3 GPUs"):
        launcher.launch_servers("/m", specs, str(tmp_path), backend="sglang", env={"CUDA_VISIBLE_DEVICES": "0"})


def test_cli_allocation_that_does_not_fit_is_one_line(tmp_path, capsys):
    # Refused before any model, server or trainer is prepared: exit 2, one line, no traceback.
    rc = launch.main(["cluster=gpu", "rollout_alloc=sglang:d64t8", f"cluster.fileroot={tmp_path}"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("areal_libra: error: cluster GPUs: the allocation needs 513 GPUs"), err


def test_new_servers_take_free_rollout_devices_only():
    pool = assign_gpus([str(i) for i in range(8)], 1, [1, 2]).pool
    assert pool == ("1", "2", "3", "4", "5", "6", "7")
    live = {"1", "2", "3"}  # the launcher's TP1 and TP2 servers
    assert place_new_servers(pool, live, [2, 1]).servers == (("4", "5"), ("6",))
    assert place_new_servers(pool, live - {"1"}, [1]).servers == (("1",),)  # a dead server's device is free
    with pytest.raises(PlacementError, match=r"need 8 GPUs \(TP 4\+4\) but 4 of the 7 rollout devices are free"):
        place_new_servers(pool, live, [4, 4])
    with pytest.raises(PlacementError, match=f"{ROLLOUT_DEVICES_ENV} unset"):
        place_new_servers((), set(), [1])


def test_fleet_places_sglang_servers_off_the_trainer_and_live_servers(monkeypatch, tmp_path):
    """A reconfiguration (or a revive) on cluster=gpu: SGLang cannot start here, so the launch is captured."""
    import os
    import subprocess
    import sys

    from areal.api.cli_args import InferenceEngineConfig, SGLangConfig
    from areal.engine.sglang_remote import RemoteSGLangEngine

    from areal_libra.config import DispatchConfig
    from areal_libra.rollout import backend as backend_mod
    from areal_libra.rollout.fleet import FleetError, build_fleet, write_registry
    from areal_libra.rollout.groups import RolloutGroup
    from areal_libra.rollout.launcher import ServerHandle, ServerLaunchError
    from areal_libra.rollout.router import RequestRouter, write_groups_file

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    tp1 = RolloutGroup("tp1", tp=1, count=1, max_len=128)
    tp2 = RolloutGroup("tp2", tp=2, count=1, max_len=256)
    p = assign_gpus([str(i) for i in range(6)], 1, [1, 2])  # trainer 0; servers 1 and 2,3; pool 1..5

    class Proc:
        def __init__(self, pid):
            self.pid = pid

        def poll(self):
            return None

    handles = [ServerHandle("127.0.0.1:1", Proc(os.getpid()), ServerSpec(tp=1, group="tp1"), gpu_ids=p.servers[0]),
               ServerHandle("127.0.0.1:2", Proc(dead.pid), ServerSpec(tp=2, group="tp2"), gpu_ids=p.servers[1])]
    write_groups_file(tmp_path, [tp1, tp2], [h.addr for h in handles])
    write_registry(tmp_path, handles)
    (tmp_path / "libra_config.yaml").write_text("device: cuda\n")
    router = RequestRouter([tp1, tp2], [[handles[0].addr], [handles[1].addr]], DispatchConfig(wandb=False, spill_ratio=None),
                           health=False)
    eng = RemoteSGLangEngine(InferenceEngineConfig(backend="sglang:d2t1", experiment_name="x", trial_name="t"))
    (tmp_path / "model").mkdir()  # the checkpoint new servers would load
    trainer = SimpleNamespace(rollout=eng, config=SimpleNamespace(actor=SimpleNamespace(path=str(tmp_path / "model")),
                                                                  sglang=SGLangConfig(mem_fraction_static=0.6)))
    monkeypatch.setenv(ROLLOUT_DEVICES_ENV, ",".join(p.pool))
    fleet = build_fleet(trainer, router, tmp_path)
    assert fleet.backend.name == "sglang" and [s.gpus for s in fleet.servers] == [("1",), ("2", "3")]
    asked = []

    def launch(path, specs, log_dir, backend, host, timeout, placement, ports):
        asked.append(placement.servers)
        # the fleet's SGLang servers: seeds after the launch's two, ports of their own
        assert [s.seed for s in specs] == [2] and len({*ports[0]}) == 2
        # and AReaL's sglang: section, as the launch's servers carry it
        flags = specs[0].extra_args
        assert flags[flags.index("--mem-fraction-static") + 1] == "0.6"
        raise ServerLaunchError("captured")

    monkeypatch.setattr(backend_mod, "launch_servers", launch)  # the fleet's local process backend starts them
    try:
        # The TP2 server is dead (a revive): its devices are free again; the live TP1 keeps device 1.
        with pytest.raises(FleetError, match="captured"):
            fleet.reconfigure([RolloutGroup("tp1", tp=1, count=1, max_len=128),
                               RolloutGroup("tp4", tp=4, count=1, max_len=256)], step=1)
        assert asked == [(("2", "3", "4", "5"),)]
        with pytest.raises(FleetError, match="need 8 GPUs") as e:
            fleet.reconfigure([tp1, RolloutGroup("tp8", tp=8, count=1, max_len=256)], step=1)
        assert "\n" not in str(e.value) and len(asked) == 1  # refused before anything starts
    finally:
        fleet.close()
        router.close()


def test_servers_to_retire_make_room_with_the_least_capacity_lost():
    pool = [str(i) for i in range(1, 8)]  # trainer on 0
    held = {"a": ("1",), "b": ("2",), "c": ("3", "4"), "d": ("5", "6", "7")}
    # Everything fits beside the live servers: nothing stops first.
    assert servers_to_retire(pool, {"a": ("1",)}, ["a"], [2, 2]) == []
    # A TP2 needs 2 devices and none is free: the two TP1 (2 devices) rather than the TP4-sized d (3).
    assert servers_to_retire(pool, held, ["a", "b", "d"], [2]) == ["a", "b"]
    # Same devices freed, fewer servers stopped: c alone rather than a and b.
    assert servers_to_retire(pool, held, ["a", "b", "c"], [2]) == ["c"]
    # A TP1: the first leaving TP1.
    assert servers_to_retire(pool, held, ["b", "a"], [1]) == ["b"]
    # Kept servers are never stopped: without d leaving, a TP4 cannot fit.
    with pytest.raises(PlacementError, match=r"need 4 GPUs \(TP 4\) but only 2 of the 7 rollout devices"):
        servers_to_retire(pool, held, ["a", "b"], [4])
