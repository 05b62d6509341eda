"""A hybrid replica's rollout side in the live run, with the real pieces: embedded servers on loopback,
AReaL's RemoteSGLangEngine + the project's RequestRouter and the rollout fleet (the one owner of membership,
which the registry asks), the registration channel over the elastic pool's TCPStore (`elastic_serving`),
`modeswitch.HttpRollout` as the hybrid drives it.

- release: the hybrid's server registers; it is routable only after the next weight update reached it
  (it serves the trainer's current weights, not its own stale ones);
- in rollout: the router sends it real requests (the router's count equals what the server finished);
- join: drain while requests run there: every request completes with all its tokens (moved to the core
  server with its tokens so far), none lost;
- pool_view / join / release over a real ElasticCore.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest

from areal_libra.rollout.groups import RolloutGroup
from areal_libra.rollout.router import DispatchConfig, RequestRouter

MAX_TOKENS = 512


def _wait(cond, timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _engine(addr: str):
    from areal.api.cli_args import InferenceEngineConfig
    from areal.engine.sglang_remote import RemoteSGLangEngine

    cfg = InferenceEngineConfig(experiment_name="elive", trial_name="t", backend="sglang:d1", setup_timeout=30,
                                request_timeout=60, request_retries=1, pause_grace_period=0.0)
    eng = RemoteSGLangEngine(cfg)
    eng.initialize(addr=[addr], train_data_parallel_size=1)
    return eng


def _request(ids: list[int], n: int):
    from areal.api.cli_args import GenerationHyperparameters
    from areal.api.io_struct import ModelRequest

    g = GenerationHyperparameters(max_new_tokens=n, max_tokens=MAX_TOKENS, temperature=1.0, ignore_eos=True)
    return ModelRequest(input_ids=list(ids), gconfig=g)


def _greedy_logprobs(addr: str, ids: list[int]) -> list[float]:
    from areal_libra.server.inprocess import http

    status, out = http(addr, "/generate", {"input_ids": ids, "return_logprob": True,
                                           "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
    assert status == 200, out
    return [x[0] for x in out["meta_info"]["output_token_logprobs"]]


def _push_update(eng, src: str, root: Path) -> None:
    """What the trainer's FSDPEngine does for a disk weight update: save, announce, let the engine post it."""
    from areal.api.io_struct import WeightUpdateMeta
    from areal.utils import name_resolve, names

    version = eng.get_version() + 1
    path = root / f"weight_update_v{version}"
    shutil.copytree(src, path)  # the update deletes its checkpoint after loading
    meta = WeightUpdateMeta(type="disk", path=str(path), version=version)
    fut = eng.update_weights_from_disk(meta)
    name_resolve.add(names.update_weights_from_disk("elive", "t", eng.get_version()),
                     str(datetime.now().timestamp()), keepalive_ttl=120)
    fut.result(timeout=60)
    eng.set_version(version)


def test_hybrid_serves_in_rollout_drains_on_join_and_returns_with_current_weights(tmp_path, tiny_model_pair):
    import torch.distributed as dist
    from areal.api.cli_args import NameResolveConfig
    from areal.utils import name_resolve

    from areal_libra.elastic_runtime.kv import KV, connect
    from areal_libra.elastic_runtime.modeswitch import HttpRollout
    from areal_libra.live.elastic_serving import ServeRegistry, serve_channel
    from areal_libra.rollout.fleet import ServerFleet
    from areal_libra.rollout.pressure import PressureSampler
    from areal_libra.server.inprocess import InProcessServer

    current, stale = tiny_model_pair  # the trainer's weights; the hybrid's own (older) ones
    name_resolve.reconfigure(NameResolveConfig(type="nfs", nfs_record_root=str(tmp_path / "nr")))
    core = InProcessServer(current, max_running_requests=32, seed=0)
    eng = _engine(core.addr)
    cfg = DispatchConfig(policy="least_loaded", sticky=False, watch_interval_s=0.1, wandb=False)
    router = RequestRouter([RolloutGroup("g0", tp=1, count=1, max_len=MAX_TOKENS)], [[core.addr]], cfg,
                           run_dir=tmp_path / "router", health=False)
    eng.set_request_router(router)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    fleet = ServerFleet(eng, router, current, tmp_path / "fleet")
    registry = ServeRegistry("127.0.0.1", store.port, "elastic", ["h0"], fleet, poll_s=0.05)
    register, unregister = serve_channel(KV(connect("127.0.0.1", store.port), "elastic"), "h0", 1, 32,
                                         ack_timeout_s=10.0)
    servers: list[InProcessServer] = []

    def launch(weights_dir: str):
        srv = InProcessServer(weights_dir, max_running_requests=32, seed=1)
        servers.append(srv)
        return f"http://{srv.addr}", srv.close

    side = HttpRollout(launch, register, unregister, ready_timeout_s=60)
    # Frequent samples with a generous timeout: on a loaded machine a 1 s /server_info timeout during the batch
    # left no sample at all (seen: active pressure 0.0).
    pressure = PressureSampler(lambda: list(eng._engine.addresses), interval_s=0.05, timeout_s=10.0)
    ids = core.tokenizer.encode("What is 12+30? ")
    want = _greedy_logprobs(core.addr, ids)
    try:
        # -- release: the hybrid starts serving on its own (stale) weights; not routable yet ---------------
        side.start(stale)
        hyb = servers[0].addr
        _wait(lambda: "h0" in registry.pending, what="registration")
        assert hyb not in eng._engine.addresses and hyb not in router.all_addresses
        assert _greedy_logprobs(hyb, ids) != want  # its own weights differ from the trainer's
        _push_update(eng, current, tmp_path)  # the next weight update reaches it, then it is routed to
        _wait(lambda: "h0" in registry.serving(), what="activation")
        assert hyb in eng._engine.addresses and hyb in router.all_addresses
        assert fleet.hybrids() == [hyb]  # attached through the fleet, the one owner of membership
        got = _greedy_logprobs(hyb, ids)
        assert got == pytest.approx(want, abs=1e-4)  # serves the trainer's current weights

        # -- in rollout: real requests through AReaL's client; the router sends the hybrid its share ------
        async def batch(n: int, tokens: int):
            return await asyncio.gather(*[eng.agenerate(_request(ids, tokens)) for _ in range(n)])

        finished0 = servers[0].engine.stats.finished_requests
        pressure.take()
        outs = asyncio.run(batch(16, 48))
        assert all(len(o.output_tokens) == 48 for o in outs)
        q, a = pressure.take()
        assert 0.0 < a <= 1.0 and 0.0 <= q <= 1.0, pressure.errors  # sampled while they ran requests
        n_hyb = router.addr_requests[hyb]
        assert 4 <= n_hyb <= 12, router.addr_requests  # least-loaded: it took a real share
        assert servers[0].engine.stats.finished_requests - finished0 == n_hyb  # the router's count is real

        # -- join: drain while requests run on the hybrid; every request completes with all its tokens ----
        box: dict = {}
        t = threading.Thread(target=lambda: box.update(outs=asyncio.run(batch(12, 300))))
        t.start()
        _wait(lambda: servers[0].engine.num_running() >= 2 and servers[0].engine.stats.generated_tokens > 0,
              what="requests running on the hybrid")
        routed_before = router.addr_requests[hyb]
        aborted0 = servers[0].engine.stats.aborted_requests
        side.drain()
        t.join(120)
        assert not t.is_alive()
        outs = box["outs"]
        assert len(outs) == 12 and all(len(o.output_tokens) == 300 for o in outs)  # none lost, none cut short
        assert servers[0].engine.stats.aborted_requests > aborted0  # some were running there when it left
        assert router.totals()["failovers"] >= 1  # ... and were moved to the core server
        assert router.addr_requests[hyb] == routed_before  # nothing routed there after the removal
        assert hyb not in eng._engine.addresses and hyb not in router.all_addresses
        assert registry.removals == 1 and fleet.hybrids() == []

        # -- release again: a new server, routable after the next update, on the current weights ----------
        side.start(stale)
        hyb2 = servers[1].addr
        _wait(lambda: "h0" in registry.pending, what="second registration")
        _push_update(eng, current, tmp_path)
        _wait(lambda: registry.serving().get("h0", ("",))[0] == hyb2, what="second activation")
        assert _greedy_logprobs(hyb2, ids) == pytest.approx(want, abs=1e-4)
        outs = asyncio.run(batch(8, 16))
        assert len(outs) == 8 and router.addr_requests[hyb2] >= 1
    finally:
        pressure.close()
        registry.close()
        if side.url is not None:
            side.drain()
        fleet.close()
        eng.destroy()
        core.close()


def test_pool_view_join_release_over_the_core(tmp_path):
    import torch.distributed as dist

    from areal_libra.config import LiveElasticConfig
    from areal_libra.elastic.state import ReplicaState
    from areal_libra.elastic_runtime.core import ElasticCore, RuntimeConfig
    from areal_libra.live.elastic_live import ElasticPoolControl

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    core = ElasticCore(store, RuntimeConfig(), 0, 1, None, str(tmp_path / "snap"), state_fn=dict,
                       hybrids=[("h0", 1), ("h1", 1)])
    router = RequestRouter([RolloutGroup("short", tp=1, count=2, threads=1, max_len=100),
                            RolloutGroup("long", tp=2, count=1, threads=2, max_len=400)],
                           [["127.0.0.1:1", "127.0.0.1:2"], ["127.0.0.1:3"]], DispatchConfig(wandb=False),
                           health=False)
    ctl = ElasticPoolControl(core, LiveElasticConfig(enabled=True, hybrids=2, server_threads=1), router=router)
    v = ctl.pool_view()
    # No hybrid process has beaten yet: none is joinable. Servers: 2 x 1 + 1 x 2 threads.
    assert (v.training, v.idle, v.train_replicas, v.rollout_gpus, v.unit_gpus, v.busy) == (0, 0, 1, 4, 1, False)
    assert ctl.join(1) == 0
    for rid in ("h0", "h1"):
        core.kv.set(f"hb/{rid}/0", time.time())  # the hybrids' heartbeats (what a worker writes)
    assert ctl.pool_view().idle == 2
    assert ctl.join(1) == 1 and core.pool.hybrid["h0"].state == ReplicaState.REQUESTED
    v = ctl.pool_view()
    assert v.busy and v.idle == 1 and v.training == 0
    h = core.pool.hybrid["h0"]
    for st in (ReplicaState.FETCHING, ReplicaState.ZERO_SYNC, ReplicaState.ACTIVATING, ReplicaState.TRAINING):
        assert core.pool.advance("h0", st, h.generation)
    v = ctl.pool_view()
    assert (v.training, v.idle, v.train_replicas, v.busy) == (1, 1, 2, False)
    assert ctl.release(5) == 1 and core.pool.hybrid["h0"].state == ReplicaState.RELEASING
    assert ctl.pool_view().busy and ctl.release(1) == 0  # nothing else is training
    assert ctl.join(0) == 0 and ctl.release(0) == 0
    store.set("elastic/shutdown", "1")


def test_live_elastic_config_has_one_decider() -> None:
    """The LibraController is the one elastic decision loop: the pool has no decide_in switch, and an elastic
    pool without the controller (static mode) or a bad script is refused at launch."""
    from areal_libra.config import ConfigError, libra_config

    with pytest.raises(ConfigError, match="decide_in"):
        libra_config({"elastic": {"decide_in": "pool"}})
    with pytest.raises(ConfigError, match="needs libra.mode=libra"):
        libra_config({"mode": "static", "elastic": {"enabled": True}})
    with pytest.raises(ConfigError, match="release_after"):
        libra_config({"elastic": {"join_at_step": 2, "release_after": 0}})
    assert libra_config({"elastic": {"enabled": True, "join_at_step": 2}}).elastic.join_at_step == 2


def test_rollout_time_from_wait_and_backlog() -> None:
    from areal_libra.elastic.measure import rollout_time

    assert rollout_time(2.0, 3.0, 0, 8) == 5.0  # waited: rollout produced one batch in train + wait
    assert rollout_time(2.0, 0.01, 4, 8) == 1.0  # no real wait, half a batch left over: rollout is ahead
    assert rollout_time(2.0, 0.0, 100, 8) == 1.0  # floored at half the train time


def test_rollout_time_from_the_rollout_sides_idle_time() -> None:
    from areal_libra.elastic.measure import IDLE_FLOOR, rollout_time

    # A 4 s step, 4 s of training, no wait; rollout idle 3 s of it (the staleness bound held it back): it
    # needed 1 s for the batch. The backlog rule says T_rollout = T_train (nothing beyond the batch).
    assert rollout_time(4.0, 0.0, 0, 8, idle_s=3.0, interval_s=4.0) == 1.0
    assert rollout_time(4.0, 0.0, 0, 8) == 4.0
    assert rollout_time(4.0, 0.0, 0, 8, idle_s=0.0, interval_s=4.0) == 4.0  # never idle: as fast as training
    assert rollout_time(4.0, 0.0, 0, 8, idle_s=10.0, interval_s=4.0) == IDLE_FLOOR * 4.0
    # Rollout never idle, the trainer waited 2 s: T_train + wait, as without the idle measurement.
    assert rollout_time(4.0, 2.0, 0, 8, idle_s=0.0, interval_s=6.0) == 6.0 == rollout_time(4.0, 2.0, 0, 8)
    # The trainer waited 0.5 s for stragglers, yet rollout idled 4.5 s of the 6.5 s step: busy 2 s against
    # the trainer's 6 s: rollout is ahead (the wait-based rule would say 4.5 s, behind).
    assert rollout_time(4.0, 0.5, 0, 8, idle_s=4.5, interval_s=6.5) == pytest.approx(4.0 * 2.0 / 6.0)


def test_idle_clock_follows_arealss_in_flight_count() -> None:
    """The real StalenessManager of AReaL, its callbacks followed: idle is the time with nothing in flight."""
    from areal.infra.staleness_manager import StalenessManager

    from areal_libra.elastic.measure import RolloutIdleClock
    from areal_libra.live.elastic_live import follow_in_flight

    class Version:
        def get_version(self) -> int:
            return 0

    t = [100.0]
    clock = RolloutIdleClock(now=lambda: t[0])
    m = StalenessManager(Version(), max_concurrent_rollouts=8, consumer_batch_size=2, max_staleness=1)
    assert follow_in_flight(m, clock) and not follow_in_flight(None, clock)
    t[0] = 101.0  # idle 1 s before the first submission
    for _ in range(2):
        m.on_rollout_enqueued()
        m.on_rollout_submitted()
    t[0] = 104.0
    m.on_rollout_accepted()  # one still running: busy
    t[0] = 105.0
    m.on_rollout_rejected()  # none running from here
    t[0] = 107.5
    assert clock.take() == pytest.approx(1.0 + 2.5)
    m.on_rollout_enqueued()
    m.on_rollout_submitted()
    t[0] = 109.0
    assert clock.take() == pytest.approx(0.0)  # busy throughout
    # AReaL's own accounting untouched: (1 + 0 + 1) * 2 - (1 accepted + 1 running) = 2
    assert m.get_capacity() == 2
