"""A trainer rank other than 0 follows rank 0's fleet: rollout_groups.json changes -> its router and engine
addresses switch together (a multi-rank trainer on Ray; without it the rank's requests wait for dead servers)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from areal_libra.live.rank_follower import LayoutFollower
from areal_libra.rollout.groups import RolloutGroup
from areal_libra.rollout.router import DispatchConfig, RequestRouter, write_groups_file

G = RolloutGroup("g0", tp=1, count=2, max_len=160)


def test_follower_switches_router_and_engine_when_rank0_replaces_a_server(tmp_path) -> None:
    old = ["10.0.0.2:1001", "10.0.0.2:1002"]
    write_groups_file(tmp_path, [G], old)
    router = RequestRouter([G], [old], DispatchConfig(wandb=False), run_dir=tmp_path, health=False)
    engine = SimpleNamespace(lock=threading.Lock(), addresses=list(old))  # AReaL's RemoteInfEngine fields used
    f = LayoutFollower(engine, router, tmp_path)
    assert not f.check_once()  # nothing changed yet
    new = ["10.0.0.2:1001", "10.0.0.1:2001"]  # the second server's node was lost; its replacement elsewhere
    write_groups_file(tmp_path, [G], new)
    assert f.check_once()
    assert router.all_addresses == new and engine.addresses == new and f.applied == 1
    assert not f.check_once()
    router.close()
