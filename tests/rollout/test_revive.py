"""A run's only rollout server is SIGKILLed under request load: the reviver (areal_libra.rollout.revive)
starts a replacement through the fleet, the requests that were on the dead server resume there, and no
request is lost (real embedded servers, AReaL's engine and the project's router on loopback)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid

import pytest

from areal_libra.rollout.backend import LocalProcessBackend
from areal_libra.rollout.fleet import ServerFleet
from areal_libra.rollout.revive import REVIVE_LOG, ServerReviver, rollout_counters
from tests.rollout.test_fleet import NEW_TOKENS, TP1, Load, make_engine, make_router

LOCAL = LocalProcessBackend("embedded")  # the fleet starts new servers as local subprocesses

pytestmark = pytest.mark.slow  # two embedded servers, one after the other


async def _one(eng):
    from areal.api.cli_args import GenerationHyperparameters
    from areal.api.io_struct import ModelRequest

    req = ModelRequest(rid=uuid.uuid4().hex, input_ids=[3, 4, 5], gconfig=GenerationHyperparameters(
        max_new_tokens=NEW_TOKENS, max_tokens=256, temperature=1.0, ignore_eos=True))
    return await eng.agenerate(req)


def test_the_only_server_killed_under_load_is_replaced_and_nothing_is_lost(tiny_model_pair, embedded_servers,
                                                                          tmp_path) -> None:
    from areal_libra.rollout.launcher import ServerSpec

    (a,) = embedded_servers(tiny_model_pair[0], [ServerSpec(tp=1, threads=1, max_running=64, group="tp1")])
    router = make_router([TP1], [[a.addr]], tmp_path)
    eng = make_engine([a.addr], "revive")
    eng.set_request_router(router)
    router.attach_engine(eng)
    fleet = ServerFleet(eng, router, tiny_model_pair[0], tmp_path / "logs", LOCAL, [a], [TP1], tmp_path)
    reviver = ServerReviver(fleet, router, tmp_path, interval_s=0.2).start()
    load = Load(eng, concurrency=4).start()
    try:
        assert reviver.check_once() is None  # nothing dead: nothing done
        a.kill()  # SIGKILL with requests in flight
        deadline = time.monotonic() + 30
        while a.addr not in router.down_addresses() and time.monotonic() < deadline:
            time.sleep(0.05)
        # A new request while no server is healthy (AReaL submits new rollouts all the time): it waits for
        # the replacement instead of failing its trajectory.
        fresh: list = []
        t = threading.Thread(target=lambda: fresh.append(asyncio.run(_one(eng))), daemon=True)
        t.start()
        deadline = time.monotonic() + 120
        while reviver.revived < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        t.join(timeout=60)
        assert fresh and len(fresh[0].output_tokens) == NEW_TOKENS
        assert reviver.revived == 1, "no replacement within 120 s"
        done = len(load.results)
        deadline = time.monotonic() + 60
        while len(load.results) < done + 8 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        load.stop()
        reviver.stop()
        fleet.close(stop_servers=True)
        router.close()
    load.check()  # every request issued came back complete, those on the dead server included
    assert router.totals()["failovers"] >= 1  # some were in flight on the killed server
    (new,) = router.all_addresses
    assert new != a.addr and eng._engine.addresses == [new]
    rec = [json.loads(x) for x in (tmp_path / REVIVE_LOG).read_text().splitlines()]
    assert rec[0]["dead"] == [a.addr] and rec[0]["started"] == [new]
    assert reviver.metrics() == {"revive/servers_replaced": 1, "revive/failed_attempts": reviver.failures,
                                 "revive/gave_up": 0.0}
    assert rollout_counters(object()) == {}  # an engine without a workflow executor reports nothing
