"""The fleet under xccl weight updates (cluster=gpu's actor.weight_update_mode), on CPU over gloo: real
torch.distributed groups, AReaL's real RemoteSGLangEngine (its init_weights_update_group with patch 11's
sizes, its update_weights_from_distributed), the project's router and fleet, and servers that join the group
the way SGLang does (tests/rigs/xccl_server.py: one process per TP rank; SGLang itself needs a GPU).

- a reconfiguration starts the new servers at once but routes to them only after the next weight update,
  which first forms the group again over the new server set (rank offsets follow the real TP sizes) and
  reaches every member;
- a dead server is replaced the same way (the reviver), and an update never waits for it;
- new servers that cannot join are dropped, the update reaches the old layout, fleet.jsonl says why;
- a replacement that keeps failing: the reviver gives up after its tries and says so once."""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from areal_libra.rollout.backend import LocalProcessBackend
from areal_libra.rollout.fleet import FLEET_LOG, REGISTRY_FILE, FleetError, ServerFleet
from areal_libra.rollout.groups import RolloutGroup, xccl_rank_offsets
from areal_libra.rollout.revive import REVIVE_LOG, ServerReviver
from areal_libra.rollout.xccl import WeightGroup
from tests.rollout.test_fleet import make_router

pytestmark = pytest.mark.slow  # server processes and gloo groups on loopback

TP1 = RolloutGroup("tp1", tp=1, count=1, threads=1, max_running=64, max_len=128)
TP2 = RolloutGroup("tp2", tp=2, count=1, threads=1, max_running=64, max_len=256)
RIG = "tests.rigs.xccl_server"


class RigBackend:
    """The launcher's local processes (LocalProcessBackend), running the xccl rig instead of a model server."""

    name, places_devices = "rig", False

    def __init__(self, extra: tuple[str, ...] = (), fail: bool = False) -> None:
        self.inner = LocalProcessBackend("embedded")
        self.extra, self.fail, self.starts = extra, fail, 0

    def start(self, weights, specs, log_dir, devices=None, weight_version=None, timeout=600.0):
        self.starts += 1
        specs = [replace(s, entry=RIG, extra_args=(*self.extra, *(["--tp-size", "none"] if self.fail else [])))
                 for s in specs]
        return self.inner.start(weights, specs, log_dir, timeout=60)

    def stop(self, server, timeout=10.0) -> None:
        server.terminate(timeout)


class Rank0:
    """What AReaL's FSDPEngine does on trainer rank 0 for an xccl update (fsdp_engine.py,
    _update_weights_from_distributed): the servers are told what comes, then rank 0 broadcasts each tensor
    over its weight-update group. The group attributes are the engine's; WeightGroup re-forms them."""

    def __init__(self, rollout) -> None:
        self.rollout = rollout
        self.weight_update_group = None
        self.weight_update_groups: list = []
        self.weight_update_group_names: list[str] = []

    def update_weights(self, meta) -> None:
        from areal.api.io_struct import ParamSpec

        meta = replace(meta, nccl_group_name=self.weight_update_group_names[0])
        tensors = weights(meta.version)
        specs = [ParamSpec(name=n, shape=tuple(t.shape), dtype=str(t.dtype).split("torch.")[1])
                 for n, t in tensors.items()]
        self.rollout.pause_generation()
        fut = self.rollout.update_weights_from_distributed(meta, specs)
        for t in tensors.values():
            dist.broadcast(t, src=0, group=self.weight_update_group)
        fut.result(timeout=60)
        self.rollout.continue_generation()


def weights(version: int) -> dict[str, torch.Tensor]:
    return {"embed": torch.arange(6.0).reshape(2, 3) * version, "norm": torch.full((4,), 0.5 * version)}


def sums(version: int) -> list[float]:
    return [float(t.double().sum()) for t in weights(version).values()]


def state(addr: str) -> dict:
    with urllib.request.urlopen(f"http://{addr}/xccl_state", timeout=10) as r:
        return json.loads(r.read())


def fleet_log(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / FLEET_LOG).read_text().splitlines()]


def registry(run_dir: Path) -> dict[str, str]:
    return {s["addr"]: s["state"] for s in json.loads((run_dir / REGISTRY_FILE).read_text())["servers"]}


def make_engine(addrs: list[str], name: str):
    from areal.api.cli_args import InferenceEngineConfig
    from areal.engine.sglang_remote import RemoteSGLangEngine

    # a group forms once every rank process has imported torch: generous on a loaded machine
    cfg = InferenceEngineConfig(backend=f"sglang:d{len(addrs)}t1", experiment_name=name, trial_name="t",
                                setup_timeout=60, request_timeout=240, request_retries=1)
    eng = RemoteSGLangEngine(cfg)
    eng.initialize(addr=list(addrs))
    return eng


def _setup(tmp_path: Path, backend: RigBackend, name: str):
    from areal.api.alloc_mode import ModelAllocation
    from areal.api.io_struct import WeightUpdateMeta

    from areal_libra.rollout.launcher import ServerSpec

    (a,) = RigBackend().start(str(tmp_path), [ServerSpec(tp=1, threads=1, group="tp1", max_running=64)], str(tmp_path / "l0"))
    eng = make_engine([a.addr], name)
    router = make_router([TP1], [[a.addr]], tmp_path)
    eng.set_request_router(router)
    rank0 = Rank0(eng._engine)
    meta = WeightUpdateMeta.from_fsdp_xccl(ModelAllocation.from_str("sglang:d1t1"))
    group = WeightGroup(rank0, eng, meta, timeout_s=200, master_address="127.0.0.1")
    group.recreate([a.addr], [1])  # what AReaL's connect_engine does at the start of the run
    fleet = ServerFleet(eng, router, str(tmp_path), tmp_path / "logs", backend, [a], [TP1], tmp_path,
                        weight_group=group)
    return a, eng, router, rank0, meta, group, fleet


def _wait_down(router, addr: str) -> None:
    deadline = time.monotonic() + 30
    while addr not in router.down_addresses() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert addr in router.down_addresses()


def test_new_servers_join_the_group_at_the_next_update_then_serve(tmp_path) -> None:
    a, eng, router, rank0, meta, group, fleet = _setup(tmp_path, RigBackend(), "xccl-grow")
    try:
        first = rank0.weight_update_group_names[0]
        assert first.startswith("update_weight_group_r")
        assert state(a.addr) == {first: {"ranks": [1], "world": 2, "received": []}}
        out = fleet.reconfigure([TP1, TP2], step=1)
        (b,) = out["started"]
        assert out["pending"] and fleet.pending and registry(tmp_path)[b] == "starting"
        # not routed yet: it holds the base weights until the next update reaches it
        assert router.all_addresses == [a.addr] and eng._engine.addresses == [a.addr]
        with pytest.raises(FleetError, match="waits for the next weight update") as e:
            fleet.reconfigure([TP1], step=1)
        assert e.value.transient

        rank0.update_weights(meta.with_version(1))  # the trainer's next update (wrapped by the fleet)
        # One group over the new set, rank offsets by the real sizes (patch 11): a TP1 then a TP2 server.
        offsets, world = xccl_rank_offsets([1, 2])
        assert (offsets, world) == ([1, 2], 4)
        second = rank0.weight_update_group_names[0]
        assert second != first and group.generation == 2  # a new group; the old one is gone on a
        assert state(a.addr) == {second: {"ranks": [1], "world": 4, "received": [sums(1)]}}
        assert state(b) == {second: {"ranks": [2, 3], "world": 4, "received": [sums(1)]}}
        assert meta.gen_server_sizes == [1, 2]  # the trainer's meta follows the servers
        assert router.all_addresses == [a.addr, b] and eng._engine.addresses == [a.addr, b]
        assert not fleet.pending and fleet.reconfigurations == 1 and registry(tmp_path) == {a.addr: "serving",
                                                                                          b: "serving"}
        rank0.update_weights(meta.with_version(2))  # same set: the same group
        assert state(b)[second]["received"] == [sums(1), sums(2)] and group.generation == 2

        # The TP1 server dies: the reviver starts a replacement, which joins at the next update; the update
        # goes to the servers that are alive, never waiting for the dead one.
        reviver = ServerReviver(fleet, router, tmp_path)
        a.kill()
        _wait_down(router, a.addr)
        rec = reviver.check_once()
        (c,) = rec["started"]
        assert rec["dead"] == [a.addr] and reviver.revived == 1 and fleet.pending
        assert reviver.check_once() is None  # a change waits: nothing more to do
        rank0.update_weights(meta.with_version(3))
        third = rank0.weight_update_group_names[0]
        assert state(c) == {third: {"ranks": [1], "world": 4, "received": [sums(3)]}}
        assert state(b)[third] == {"ranks": [2, 3], "world": 4, "received": [sums(3)]}
        assert second not in state(b)  # the old group was destroyed on the servers
        assert router.all_addresses == [c, b] and eng._engine.addresses == [c, b]
        log = fleet_log(tmp_path)
        assert [("pending" in r, "landed" in r) for r in log] == [(True, False), (False, False), (False, True),
                                                                 (True, False), (False, True)]
        assert log[1]["failed"].startswith("reconfigure: the last change") and log[1]["transient"]
        assert log[2]["landed"] == 1 and log[2]["started"] == [b] and log[4]["landed"] == 3
    finally:
        fleet.close(stop_servers=True)
        router.close()
        eng.destroy()
        a.terminate()


def test_servers_that_cannot_join_are_dropped_and_the_update_reaches_the_old_layout(tmp_path) -> None:
    a, eng, router, rank0, meta, group, fleet = _setup(tmp_path, RigBackend(extra=("--refuse-groups",)),
                                                      "xccl-refuse")
    try:
        first = rank0.weight_update_group_names[0]
        (b,) = fleet.reconfigure([TP1, TP2], step=4)["started"]
        handle = next(s for s in fleet.servers if s.addr == b)
        rank0.update_weights(meta.with_version(5))  # must not raise: the trainer goes on
        assert state(a.addr)[first]["received"] == [sums(5)]  # over the old group
        assert rank0.weight_update_group_names == [first] and group.generation == 1
        assert not fleet.pending and not handle.alive() and fleet.groups == [TP1]
        assert router.all_addresses == [a.addr] and eng._engine.addresses == [a.addr]
        assert registry(tmp_path) == {a.addr: "serving"}
        failed = fleet_log(tmp_path)[-1]
        assert failed["step"] == 4 and "did not join the weight-update group" in failed["failed"]
        assert "refuses" in failed["failed"] and not failed["transient"]
    finally:
        fleet.close(stop_servers=True)
        router.close()
        eng.destroy()
        a.terminate()


def test_the_reviver_gives_up_on_a_replacement_that_keeps_failing_and_says_so_once(tmp_path) -> None:
    backend = RigBackend()
    a, eng, router, rank0, meta, group, fleet = _setup(tmp_path, backend, "xccl-giveup")
    try:
        backend.fail = True  # every server it starts exits at once (a bad --tp-size)
        reviver = ServerReviver(fleet, router, tmp_path, max_tries=2)
        a.kill()
        _wait_down(router, a.addr)
        for _ in range(5):
            assert reviver.check_once() is None
        assert backend.starts == 2 and reviver.failures == 2  # two tries, then no more
        assert reviver.gave_up is not None and "cannot start" in reviver.gave_up
        (rec,) = [json.loads(x) for x in (tmp_path / REVIVE_LOG).read_text().splitlines()]
        assert rec["dead"] == [a.addr] and rec["tries"] == 2 and rec["gave_up"] == reviver.gave_up
        assert reviver.metrics()["revive/gave_up"] == 1.0
        # A layout change (a re-plan that succeeded) is a new situation: the reviver tries again.
        backend.fail = False
        fleet.reconfigurations += 1
        (c,) = reviver.check_once()["started"]
        assert reviver.gave_up is None and fleet.pending
        rank0.update_weights(meta.with_version(1))
        assert state(c)[rank0.weight_update_group_names[0]] == {"ranks": [1], "world": 2, "received": [sums(1)]}
    finally:
        fleet.close(stop_servers=True)
        router.close()
        eng.destroy()
        a.terminate()
