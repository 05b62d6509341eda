"""Break-before-make on a full node: the new layout needs devices the leaving servers hold.

Real embedded servers given a device pool (the ids are bookkeeping on CPU, as CUDA_VISIBLE_DEVICES would be on
a GPU node): the leaving servers whose devices are needed are stopped first, the new ones start on those
devices, and no request is lost; a new layout that fails to start gives the old layout back on those devices.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from areal_libra.rollout.backend import LocalProcessBackend
from areal_libra.rollout.fleet import REGISTRY_FILE, FleetError, FleetServer, ServerFleet
from areal_libra.rollout.groups import RolloutGroup
from areal_libra.rollout.revive import REVIVE_LOG, ServerReviver
from tests.rollout.test_fleet import TP2, Load, greedy, make_engine, make_router

LOCAL = LocalProcessBackend("embedded")  # the fleet starts new servers as local subprocesses

pytestmark = pytest.mark.slow  # five embedded servers on loopback

TP1x = RolloutGroup("tp1", tp=1, count=2, threads=1, max_running=64, max_len=128)


@pytest.fixture(scope="module")
def servers(tiny_model_pair, embedded_servers):
    from areal_libra.rollout.launcher import ServerSpec

    return embedded_servers(tiny_model_pair[0], [ServerSpec(tp=1, threads=1, max_running=64, group="tp1")] * 5,
                            timeout=240)


def on_devices(handles, devices) -> list[FleetServer]:
    """The fleet's view of launcher servers, each holding one device of the pool."""
    return [FleetServer(h.addr, "tp1", 1, 1, 64, h.proc.pid, h, "trainer", h.log_path, (d,))
            for h, d in zip(handles, devices)]


def wait_for(cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "the load made no progress on the new layout"
        time.sleep(0.05)


@contextlib.contextmanager
def full_pool(handles, group: RolloutGroup, model: str, run_dir: Path) -> Iterator[tuple[ServerFleet, Load]]:
    """A fleet of `handles` on a device pool they fill (one device each), under load. On a normal exit the
    load must make progress on the final layout; the caller checks that nothing was lost (load.check)."""
    addrs = [h.addr for h in handles]
    router = make_router([group], [addrs], run_dir)
    eng = make_engine(addrs, f"fleet-pool-{run_dir.name}")
    eng.set_request_router(router)
    devices = tuple(str(i) for i in range(len(handles)))
    fleet = ServerFleet(eng, router, model, run_dir / "logs", LOCAL, on_devices(handles, devices), [group],
                        run_dir, rollout_devices=devices)
    load = Load(eng).start()
    try:
        yield fleet, load
        done = len(load.results)
        wait_for(lambda: len(load.results) >= done + 8)
    finally:
        load.stop()
        eng.destroy()
        router.close()
        fleet.close(stop_servers=True)


def registry(run_dir: Path) -> dict[str, list[str]]:
    return {r["addr"]: r["gpus"] for r in json.loads((run_dir / REGISTRY_FILE).read_text())["servers"]}


def test_the_leaving_servers_a_new_layout_needs_stop_first(servers, tiny_model_pair, tmp_path) -> None:
    """Pool 0,1,2 full with three TP1. 3xTP1 -> 1xTP1 + 1xTP2: the TP2 needs two devices and none is free, so
    two leaving TP1 stop first and the TP2 starts on their devices; the kept TP1 serves throughout. Then
    -> 3xTP1 again: the TP2 stops first, two TP1 start on its devices. Under load, nothing is lost."""
    a, b, c = servers[:3]
    three = RolloutGroup("tp1", tp=1, count=3, threads=1, max_running=64, max_len=128)
    one = RolloutGroup("tp1", tp=1, count=1, threads=1, max_running=64, max_len=128)
    with full_pool([a, b, c], three, tiny_model_pair[0], tmp_path) as (fleet, load):
        # The reviver looks while the stopped servers are still the fleet's: it must not count them as replaced.
        reviver = ServerReviver(fleet, fleet.router, tmp_path)
        start, looked = fleet._start, []

        def start_while_the_reviver_looks(*args):
            t = threading.Thread(target=lambda: looked.append((reviver.dead(), reviver.check_once())))
            t.start()
            looked.append(t)
            return start(*args)

        fleet._start = start_while_the_reviver_looks
        out = fleet.reconfigure([one, TP2], step=1)
        fleet._start = start
        looked[0].join(60)
        assert sorted(looked[1][0]) == sorted([b.addr, c.addr]) and looked[1][1] is None
        assert reviver.revived == 0 and not (tmp_path / REVIVE_LOG).exists()
        assert sorted(out["stopped"]) == sorted([b.addr, c.addr]) and len(out["started"]) == 1
        (d_addr,) = out["started"]
        assert registry(tmp_path) == {a.addr: ["0"], d_addr: ["1", "2"]}
        assert not b.alive() and not c.alive() and a.alive()
        out = fleet.reconfigure([three], step=2)
        assert out["stopped"] == [d_addr] and len(out["started"]) == 2
        assert sorted(registry(tmp_path).values()) == [["0"], ["1"], ["2"]]
        assert all(greedy(s)[0] == greedy(a.addr)[0] for s in out["started"])  # same weights everywhere
    load.check()


def test_a_layout_that_needs_every_device_and_fails_gives_the_old_one_back(servers, tiny_model_pair,
                                                                          tmp_path) -> None:
    """Pool 0,1 full with two TP1. -> 1xTP2 needs both devices: both TP1 stop first, so requests wait for the
    new server. The first attempt fails to start: two TP1 start again on devices 0 and 1 and the FleetError
    says so; the second attempt succeeds. Under load, nothing is lost."""
    g, h = servers[3:5]
    attempts: list[list[int]] = []
    with full_pool([g, h], TP1x, tiny_model_pair[0], tmp_path) as (fleet, load):
        start = fleet._start

        def fail_the_first_tp2(target, slots, path, version):
            tps = [grp.tp for grp, row in zip(target, slots) for s in row if s is None]
            attempts.append(tps)
            if tps == [2] and len(attempts) == 1:
                raise FleetError("reconfigure: cannot start TP2 (tp2): injected")
            return start(target, slots, path, version)

        fleet._start = fail_the_first_tp2
        with pytest.raises(FleetError, match=r"injected; the old layout serves again") as e:
            fleet.reconfigure([TP2], step=1)
        assert "\n" not in str(e.value)
        assert attempts == [[2], [1, 1]] and not g.alive() and not h.alive()
        assert fleet.groups == [TP1x] and sorted(registry(tmp_path).values()) == [["0"], ["1"]]
        out = fleet.reconfigure([TP2], step=2)
        assert len(out["stopped"]) == 2 and len(out["started"]) == 1
        assert list(registry(tmp_path).values()) == [["0", "1"]]
    load.check()
