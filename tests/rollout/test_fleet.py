"""Live reconfiguration of rollout server groups (areal_libra.rollout.fleet) with real embedded servers,
AReaL's real RemoteSGLangEngine and the project's RequestRouter on loopback, under continuous request
load: servers are added and removed while requests are in flight, new servers serve the current weights,
a server SIGKILLed mid-reconfiguration loses no request, and a group that cannot start leaves the old
layout serving."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from areal_libra.config import DispatchConfig
from areal_libra.rollout.backend import LocalProcessBackend
from areal_libra.rollout.fleet import (
    REGISTRY_FILE,
    FleetError,
    ServerFleet,
    build_fleet,
    read_registry,
    write_registry,
)
from areal_libra.rollout.groups import RolloutGroup
from areal_libra.rollout.router import GROUPS_FILE, RequestRouter, read_groups_file, write_groups_file

LOCAL = LocalProcessBackend("embedded")  # the fleet starts new servers as local subprocesses

pytestmark = pytest.mark.slow  # four embedded servers on loopback

NEW_TOKENS = 40
TP1 = RolloutGroup("tp1", tp=1, count=1, threads=1, max_running=64, max_len=128)
TP2 = RolloutGroup("tp2", tp=2, count=1, threads=2, max_running=64, max_len=256)


@pytest.fixture(scope="module")
def servers(tiny_model_pair, embedded_servers):
    """Four TP1 servers on the first model, started together: a (test 1), e and f (tests 2 and 3), g (the
    weight-update record, then the checkpoint pin, which stops it)."""
    from areal_libra.rollout.launcher import ServerSpec

    hs = embedded_servers(tiny_model_pair[0], [ServerSpec(tp=1, threads=1, max_running=64, group="tp1")] * 4,
                          timeout=240)
    return dict(zip("aefg", hs))


def make_engine(addrs: list[str], name: str):
    from areal.api.cli_args import InferenceEngineConfig
    from areal.engine.sglang_remote import RemoteSGLangEngine

    cfg = InferenceEngineConfig(backend=f"sglang:d{len(addrs)}t1", experiment_name=name, trial_name="t",
                                max_concurrent_rollouts=64, consumer_batch_size=64, setup_timeout=60,
                                request_timeout=60, request_retries=1)
    eng = RemoteSGLangEngine(cfg)
    eng.initialize(addr=list(addrs))
    return eng


def make_router(groups, addrs, run_dir: Path, policy: str = "least_loaded") -> RequestRouter:
    cfg = DispatchConfig(policy=policy, spill_ratio=None, health_interval_s=0.5, health_timeout_s=2.0, fail_after=1,
                         watch_interval_s=0.2, wandb=False)
    return RequestRouter(groups, addrs, cfg, run_dir=run_dir)


class Load:
    """Keeps `concurrency` requests in flight through engine.agenerate (hence the router) until stopped."""

    def __init__(self, eng, concurrency: int = 4, new_tokens: int = NEW_TOKENS) -> None:
        self.eng, self.concurrency, self.new_tokens = eng, concurrency, new_tokens
        self.issued = 0
        self.results: list[tuple[int, str]] = []
        self.errors: list[str] = []
        self.inflight = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _one(self, i: int) -> None:
        from areal.api.cli_args import GenerationHyperparameters
        from areal.api.io_struct import ModelRequest

        while not self._stop.is_set():
            req = ModelRequest(rid=uuid.uuid4().hex, input_ids=[5 + i, 7, 9, 11 + self.issued % 30],
                               gconfig=GenerationHyperparameters(max_new_tokens=self.new_tokens, max_tokens=1024,
                                                                 temperature=1.0, ignore_eos=True))
            self.issued += 1
            self.inflight += 1
            try:
                resp = await self.eng.agenerate(req)
                self.results.append((len(resp.output_tokens), resp.stop_reason))
            except Exception as e:  # noqa: BLE001 - recorded and asserted on
                self.errors.append(f"{type(e).__name__}: {e}")
            finally:
                self.inflight -= 1

    async def _main(self) -> None:
        await asyncio.gather(*(self._one(i) for i in range(self.concurrency)))

    def start(self) -> Load:
        self._thread.start()
        deadline = time.monotonic() + 30
        while len(self.results) < self.concurrency and time.monotonic() < deadline:
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=120)
        assert not self._thread.is_alive()

    def check(self) -> None:
        """Nothing lost: every request issued came back complete (a moved request keeps its tokens)."""
        assert self.errors == []
        assert len(self.results) == self.issued > 0
        assert all(n == self.new_tokens and r == "length" for n, r in self.results), self.results


def server_requests(addr: str) -> int:
    with urllib.request.urlopen(f"http://{addr}/get_server_info", timeout=10) as r:
        st = json.loads(r.read())["engine_stats"]
    return int(st["finished_requests"]) + int(st["aborted_requests"])


def greedy(addr: str) -> tuple[list[int], list[float], str]:
    body = {"input_ids": [3, 1, 4, 1, 5, 9, 2, 6], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}
    req = urllib.request.Request(f"http://{addr}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        out = json.loads(r.read())
    lps = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
    return out["output_ids"], lps, str(out["meta_info"]["weight_version"])


def layout(run_dir: Path) -> dict[str, list[str]]:
    groups, addrs = read_groups_file(run_dir / GROUPS_FILE)
    return {g.name: a for g, a in zip(groups, addrs)}


def disk_weight_update(eng, tmp_path: Path, name: str, model_dir: str, version: int) -> str:
    """AReaL's disk weight update as the trainer does it (checkpoint, name_resolve entry, then
    /update_weights_from_disk on every server of the engine); returns the checkpoint path."""
    from areal.api.cli_args import NameResolveConfig
    from areal.api.io_struct import WeightUpdateMeta
    from areal.utils import name_resolve, names

    name_resolve.reconfigure(NameResolveConfig(type="nfs", nfs_record_root=str(tmp_path / "name_resolve")))
    meta = WeightUpdateMeta.from_disk(name, "t", str(tmp_path / "ckpt")).with_version(version)
    assert meta.clear_checkpoint_after_load  # AReaL deletes it after loading; the fleet keeps it
    shutil.copytree(model_dir, meta.path)  # what the actor's save would write
    fut = eng.update_weights_from_disk(meta)
    name_resolve.add(names.update_weights_from_disk(name, "t", eng.get_version()), str(time.time()),
                     keepalive_ttl=120)
    fut.result(timeout=120)
    eng.set_version(version)
    return meta.path


def test_add_then_remove_servers_under_load_with_current_weights(servers, tiny_model_pair, tmp_path) -> None:
    """After a disk weight update, 1xTP1 -> 1xTP1+1xTP2 -> 1xTP2 while requests are in flight: the new server
    reports the engine's version and answers like the updated old server (not like the initial weights),
    takes traffic; the removed one is drained and stopped; nothing is lost; files and addresses follow."""
    a = servers["a"]
    initial = greedy(a.addr)
    router = make_router([TP1], [[a.addr]], tmp_path)
    eng = make_engine([a.addr], "fleet-a")
    eng.set_request_router(router)
    fleet = ServerFleet(eng, router, tiny_model_pair[0], tmp_path / "logs", LOCAL, [a], [TP1], tmp_path)
    ckpt = disk_weight_update(eng, tmp_path, "fleet-a", tiny_model_pair[1], version=1)
    assert Path(ckpt).is_dir()
    updated = greedy(a.addr)
    assert updated[:2] != initial[:2]  # the update took: the second model answers differently
    load = Load(eng, concurrency=3).start()
    try:
        assert load.inflight > 0
        grown = fleet.reconfigure([TP1, TP2], step=3)
        (c_addr,) = grown["started"]
        new = greedy(c_addr)
        assert new[2] == "1"  # the engine's version, before it took any request
        assert new[0] == updated[0] and new[1] == pytest.approx(updated[1], abs=1e-3)
        assert grown["stopped"] == [] and grown["groups"] == "embedded:d1t1+d1t2"
        assert eng._engine.addresses == [a.addr, c_addr] and router.all_addresses == [a.addr, c_addr]
        assert layout(tmp_path) == {"tp1": [a.addr], "tp2": [c_addr]}
        deadline = time.monotonic() + 60
        while router.addr_requests.get(c_addr, 0) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert router.addr_requests[c_addr] >= 3  # the new server gets traffic
        assert load.inflight > 0 and router.inflight(a.addr) > 0  # the next switch drains a busy server
        shrunk = fleet.reconfigure([TP2], step=4)
        routed_a = router.addr_requests[a.addr]
        time.sleep(1.0)
        assert router.addr_requests[a.addr] == routed_a  # nothing routed to the removed server any more
    finally:
        load.stop()
        eng.destroy()
        router.close()
    print(f"grow {grown}; shrink {shrunk}; issued {load.issued}")
    assert shrunk["started"] == [] and shrunk["stopped"] == [a.addr] and shrunk["reconfig_s"] > 0
    assert not a.alive() and eng._engine.addresses == [c_addr] and router.all_addresses == [c_addr]
    assert layout(tmp_path) == {"tp2": [c_addr]}
    reg = read_registry(tmp_path)
    assert [(r["addr"], r["group"], r["owner"], r["state"]) for r in reg] == [(c_addr, "tp2", "trainer", "serving")]
    c = fleet.servers[0]
    assert c.pid == c.handle.proc.pid and c.alive()
    load.check()
    tot = router.totals()
    assert tot["routed"] == load.issued == sum(tot["group_requests"].values())  # every request came back
    # the new server served what it was sent (+1: the greedy probe above, sent to it directly)
    assert server_requests(c_addr) == router.addr_requests[c_addr] + 1
    events = [json.loads(x) for x in (tmp_path / "fleet.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events] == [3, 4]
    fleet.close(stop_servers=True)
    assert not c.alive() and not Path(ckpt).exists()  # the kept checkpoint goes with the fleet


def test_a_finished_weight_update_is_recorded_before_its_waiter_wakes(servers, tiny_model_pair, tmp_path) -> None:
    """The trainer waits on the update's future and may reconfigure right after: by then the fleet must have
    recorded the update. A future wakes its waiters before it runs its callbacks, so other callbacks on
    AReaL's future that run first (made slow here) used to leave the update 'in progress' (a CI failure)."""
    g = servers["g"]
    router = make_router([TP1], [[g.addr]], tmp_path)
    eng = make_engine([g.addr], "fleet-w")
    eng.set_request_router(router)
    inner = eng._engine
    areal_update = inner.update_weights_from_disk

    def update_with_a_slow_callback(meta):
        fut = areal_update(meta)
        fut.add_done_callback(lambda _: time.sleep(0.5))
        return fut

    inner.update_weights_from_disk = update_with_a_slow_callback
    fleet = ServerFleet(eng, router, tiny_model_pair[0], tmp_path / "logs", LOCAL, [g], [TP1], tmp_path)
    try:
        ckpt = disk_weight_update(eng, tmp_path, "fleet-w", tiny_model_pair[1], version=1)
        assert fleet.current_weights() == (ckpt, 1)
    finally:
        eng.destroy()
        router.close()
        fleet.close(stop_servers=False)


def test_hybrids_attach_and_detach_through_the_fleet(servers, tiny_model_pair, tmp_path) -> None:
    """An elastic hybrid's server (in-process, as a hybrid replica runs it) joins through the fleet: attached,
    the next disk weight update reaches it and it is routed once that update landed (before the trainer's
    wait returns); a reconfiguration keeps it in the router and the engine's addresses; detached, it leaves
    both and the next update no longer reaches it."""
    from areal_libra.server.inprocess import InProcessServer

    g = servers["g"]
    router = make_router([TP1], [[g.addr]], tmp_path)
    eng = make_engine([g.addr], "fleet-h")
    eng.set_request_router(router)
    fleet = ServerFleet(eng, router, tiny_model_pair[0], tmp_path / "logs", LOCAL, [g], [TP1], tmp_path)
    hyb = InProcessServer(tiny_model_pair[0], max_running_requests=16)
    ready: list[tuple[str, bool]] = []
    try:
        fleet.attach_hybrid(hyb.addr, "tp1", lambda addr, ok: ready.append((addr, ok)))
        assert hyb.addr not in eng._engine.addresses and hyb.addr not in router.all_addresses  # own weights yet
        assert fleet.hybrid_addresses() == {hyb.addr} and fleet.hybrids() == []  # lent already, not routed
        disk_weight_update(eng, tmp_path, "fleet-h", tiny_model_pair[1], version=1)
        assert ready == [(hyb.addr, True)]  # recorded before the update's waiter woke
        assert eng._engine.addresses == [g.addr, hyb.addr] and router.all_addresses == [g.addr, hyb.addr]
        assert greedy(hyb.addr)[2] == "1" and fleet.hybrids() == [hyb.addr]
        short = RolloutGroup("short", tp=1, count=1, threads=1, max_running=64, max_len=128)
        out = fleet.reconfigure([short], step=2)  # g stays (same kind), renamed: a real switch
        assert out["started"] == out["stopped"] == [] and [gr.name for gr in router.groups] == ["short"]
        assert eng._engine.addresses == [g.addr, hyb.addr] and set(router.all_addresses) == {g.addr, hyb.addr}
        assert layout(tmp_path) == {"short": [g.addr]}  # the fleet's own servers; the hybrid is not its
        assert fleet.hybrid_addresses() == {hyb.addr}
        assert fleet.detach_hybrid(hyb.addr) and fleet.hybrids() == [] and fleet.hybrid_addresses() == set()
        assert eng._engine.addresses == [g.addr] and router.all_addresses == [g.addr]
        disk_weight_update(eng, tmp_path / "v2", "fleet-h", tiny_model_pair[0], version=2)
        assert greedy(g.addr)[2] == "2" and greedy(hyb.addr)[2] == "1"  # detached: the update passed it by
        assert ready == [(hyb.addr, True)] and not fleet.detach_hybrid(hyb.addr)
    finally:
        eng.destroy()
        router.close()
        fleet.close(stop_servers=False)
        hyb.close()


class InProcessBackend:
    """A second real ServerBackend: embedded servers inside this process (server/inprocess.py). The fleet is
    handed it and starts and stops servers through it, unchanged."""

    name, places_devices = "inprocess", False

    def __init__(self) -> None:
        self.started: list[tuple[str, str, int | None]] = []
        self.stopped: list[str] = []

    def start(self, weights, specs, log_dir, devices=None, weight_version=None, timeout=600.0):
        from areal_libra.server.inprocess import InProcessServer

        out = []
        for spec in specs:
            srv = InProcessServer(weights, max_running_requests=spec.max_running, seed=spec.seed,
                                  weight_version="default" if weight_version is None else str(weight_version))
            out.append(SimpleNamespace(addr=srv.addr, spec=spec, log_path="", gpu_ids=(), pid=None, server=srv,
                                       alive=srv._thread.is_alive))
            self.started.append((srv.addr, weights, weight_version))
        return out

    def stop(self, server, timeout=10.0) -> None:
        server.server.close()
        self.stopped.append(server.addr)


def test_the_fleet_starts_and_stops_servers_through_the_backend_it_is_given(servers, tiny_model_pair,
                                                                             tmp_path) -> None:
    g = servers["g"]
    router = make_router([TP1], [[g.addr]], tmp_path)
    eng = make_engine([g.addr], "fleet-b")
    eng.set_request_router(router)
    backend = InProcessBackend()
    fleet = ServerFleet(eng, router, tiny_model_pair[0], tmp_path / "logs", backend, [g], [TP1], tmp_path)
    try:
        ckpt = disk_weight_update(eng, tmp_path, "fleet-b", tiny_model_pair[1], version=1)
        grown = fleet.reconfigure([TP1, TP2], step=1)
        (c_addr,) = grown["started"]
        assert backend.started == [(c_addr, ckpt, 1)]  # the current weights, at the engine's version
        assert grown["groups"] == "inprocess:d1t1+d1t2" and greedy(c_addr)[2] == "1"
        assert eng._engine.addresses == [g.addr, c_addr] and router.all_addresses == [g.addr, c_addr]
        shrunk = fleet.reconfigure([TP1], step=2)
        assert shrunk["stopped"] == [c_addr] and backend.stopped == [c_addr]  # stopped by its backend
        assert eng._engine.addresses == [g.addr] and g.alive()
    finally:
        eng.destroy()
        router.close()
        fleet.close(stop_servers=False)
        for addr, *_ in backend.started:
            assert addr in backend.stopped


def test_a_weight_update_while_new_servers_start_keeps_their_checkpoint(servers, tiny_model_pair, tmp_path) -> None:
    """A weight update lands while a new server is being started from the last checkpoint (a revive during
    training): that checkpoint stays on disk until the reconfiguration ends (it used to be deleted under the
    starting server, which failed once and was retried), and the new server ends on the newest weights."""
    g = servers["g"]
    router = make_router([TP1], [[g.addr]], tmp_path)
    eng = make_engine([g.addr], "fleet-d")
    eng.set_request_router(router)
    fleet = ServerFleet(eng, router, tiny_model_pair[0], tmp_path / "logs", LOCAL, [g], [TP1], tmp_path)
    ckpt1 = disk_weight_update(eng, tmp_path, "fleet-d", tiny_model_pair[1], version=1)
    start = fleet._start
    seen: list[bool] = []

    def start_after_an_update(target, slots, path, version):
        # The fault at a fixed point: the next training step's weight update lands before the server loads.
        disk_weight_update(eng, tmp_path / "v2", "fleet-d", tiny_model_pair[0], version=2)
        seen.append(Path(path).is_dir())
        return start(target, slots, path, version)

    fleet._start = start_after_an_update
    try:
        out = fleet.reconfigure([TP1, TP2], step=5)
    finally:
        eng.destroy()
        router.close()
    assert seen == [True] and out["started"]  # the pinned checkpoint survived the update; the start worked
    (c_addr,) = out["started"]
    assert greedy(c_addr)[2] == "2"  # then moved to the newest weights before it served
    assert not Path(ckpt1).exists()  # and the stale checkpoint is gone after the reconfiguration
    fleet.close(stop_servers=True)


def test_a_group_that_cannot_start_leaves_the_old_layout(servers, tiny_model_pair, tmp_path) -> None:
    e, f = servers["e"], servers["f"]
    two = RolloutGroup("tp1", tp=1, count=2, threads=1, max_running=64, max_len=128)
    router = make_router([two], [[e.addr, f.addr]], tmp_path)
    eng = make_engine([e.addr, f.addr], "fleet-d")
    eng.set_request_router(router)
    # as in a run: the launcher wrote the groups file and the registry; the trainer builds the fleet
    write_groups_file(tmp_path, [two], [e.addr, f.addr])
    write_registry(tmp_path, [e, f])
    (tmp_path / "libra_config.yaml").write_text("device: cpu\n")
    trainer = SimpleNamespace(rollout=eng, config=SimpleNamespace(actor=SimpleNamespace(path=tiny_model_pair[0])))
    fleet = build_fleet(trainer, router, tmp_path, start_timeout_s=0.3)
    assert [(s.addr, s.pid, s.owner) for s in fleet.servers] == [(h.addr, h.proc.pid, "launcher") for h in (e, f)]
    assert fleet.backend.name == "embedded" and fleet.log_dir == tmp_path / "servers"
    files = {p: (tmp_path / p).read_text() for p in (GROUPS_FILE, REGISTRY_FILE)}
    try:
        with pytest.raises(FleetError) as bad:
            fleet.reconfigure([RolloutGroup("tp0", tp=0, count=1, max_len=128)], step=1)
        assert "tp must be a positive integer" in str(bad.value) and "\n" not in str(bad.value)
        with pytest.raises(FleetError) as slow:
            fleet.reconfigure([two, TP2], step=1)  # cannot become healthy in 0.3 s
        assert "cannot start TP2 (tp2)" in str(slow.value) and "\n" not in str(slow.value)
        assert router.all_addresses == eng._engine.addresses == [e.addr, f.addr]
        assert {p: (tmp_path / p).read_text() for p in files} == files
        load = Load(eng, concurrency=2).start()
        load.stop()
        load.check()
    finally:
        eng.destroy()
        router.close()
    started = list((tmp_path / "servers").glob("server*_tp2_*.log"))
    assert len(started) == 1  # it was started, and stopped again:
    assert all(h.alive() for h in (e, f)) and len(fleet.servers) == 2


def test_sigkill_of_a_draining_server_loses_no_request(servers, tiny_model_pair, tmp_path) -> None:
    """2xTP1 -> 1xTP1: the server being drained is SIGKILLed with requests on it; they resume on the kept
    server and the reconfiguration completes."""
    e, f = servers["e"], servers["f"]
    two = RolloutGroup("tp1", tp=1, count=2, threads=1, max_running=64, max_len=128)
    router = make_router([two], [[e.addr, f.addr]], tmp_path)
    eng = make_engine([e.addr, f.addr], "fleet-c")
    eng.set_request_router(router)
    fleet = ServerFleet(eng, router, tiny_model_pair[0], tmp_path / "logs", LOCAL, [e, f], [two], tmp_path,
                        drain_timeout_s=60)
    killed: list[tuple[str, int]] = []
    drain = fleet._drain

    def drain_after_a_kill(leaving):
        # The fault at a fixed point: the leaving server is out of the layout, its requests still on it. (A
        # polling killer thread raced the drain on a loaded machine and sometimes found nothing in flight.)
        victim = next(h for h in (e, f) if h.addr == leaving[0].addr)
        killed.append((victim.addr, router.inflight(victim.addr)))
        victim.kill()
        return drain(leaving)

    fleet._drain = drain_after_a_kill
    # Long requests: the ones on the leaving server are still running when its drain begins.
    load = Load(eng, concurrency=6, new_tokens=400).start()
    try:
        deadline = time.monotonic() + 30
        while min(router.inflight(e.addr), router.inflight(f.addr)) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        out = fleet.reconfigure([TP1], step=7)
        time.sleep(0.5)
    finally:
        load.stop()
        eng.destroy()
        router.close()
    assert killed, "the fleet never drained a server"
    victim, on_it = killed[0]
    assert on_it > 0, "the leaving server had no request in flight to lose"
    assert out["stopped"] == [victim] and out["started"] == []
    kept = e.addr if victim == f.addr else f.addr
    assert router.all_addresses == eng._engine.addresses == [kept]
    load.check()
    assert router.totals()["failovers"] >= 1
    assert layout(tmp_path) == {"tp1": [kept]}
    assert [r["addr"] for r in read_registry(tmp_path)] == [kept]


def test_launcher_supervises_and_cleans_up_from_the_registry(tmp_path) -> None:
    """launch.py reads servers.json: a dead serving server counts as dead, a server the trainer left behind
    is killed at exit, a pid whose command line names another port is left alone."""
    import os
    import subprocess
    import sys

    from areal_libra.launch import dead_servers, kill_leftover_servers
    from areal_libra.utils import atomic_write_text, pid_alive

    def sleeper(port: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "--port", str(port)],
                                start_new_session=True)

    left, other, gone = sleeper(40001), sleeper(40002), sleeper(40003)
    gone.kill()
    gone.wait()
    try:
        reg = [{"addr": "127.0.0.1:40001", "pid": left.pid, "state": "serving"},
               {"addr": "127.0.0.1:49999", "pid": other.pid, "state": "serving"},  # pid recycled elsewhere
               {"addr": "127.0.0.1:40003", "pid": gone.pid, "state": "serving"}]
        atomic_write_text(tmp_path / REGISTRY_FILE, json.dumps({"servers": reg}))
        assert dead_servers(tmp_path, []) == (["127.0.0.1:40003"], 3)
        # Every server stopped to make room for a new layout (break-before-make): not "all servers died",
        # although the launcher's own (first) servers are gone.
        draining = [{**r, "state": "draining"} for r in reg]
        atomic_write_text(tmp_path / REGISTRY_FILE, json.dumps({"servers": draining}))
        launcher_own = SimpleNamespace(addr="127.0.0.1:40003", alive=lambda: False)
        assert dead_servers(tmp_path, [launcher_own]) == ([], 0)
        atomic_write_text(tmp_path / REGISTRY_FILE, json.dumps({"servers": reg}))
        assert kill_leftover_servers(tmp_path) == [left.pid]
        left.wait(timeout=10)
        assert not pid_alive(left.pid) and pid_alive(other.pid) and os.path.exists(f"/proc/{other.pid}")
    finally:
        for p in (left, other):
            p.kill()
            p.wait()
