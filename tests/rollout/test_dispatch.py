"""The request router AReaL calls: C-MLFQ placement and migration, load accounting, online accuracy,
live tree (rebuild off the request path, save, reload on recover), failover and health over loopback."""

from __future__ import annotations

import asyncio
import http.server
import json
import socket
import threading
import time
from pathlib import Path

import pytest
from areal.api.io_struct import ModelRequest

from areal_libra.rollout.groups import RolloutGroup
from areal_libra.rollout.live_tree import TREE_FILE, WINDOW_FILE
from areal_libra.rollout.router import (
    DispatchConfig,
    RequestRouter,
    ServerDown,
    build_router,
    write_groups_file,
)
from areal_libra.trace import Segment, ToolReturn, Trajectory
from areal_libra.utils import free_port

SHORT = RolloutGroup("short", tp=1, count=2, max_len=100)
LONG = RolloutGroup("long", tp=2, count=1, max_len=400)
ADDRS = [["127.0.0.1:1", "127.0.0.1:2"], ["127.0.0.1:3"]]
NOSTART = {"start_lookup": False, "min_samples": 2}


def make_router(tmp_path: Path | None = None, addrs=ADDRS, **kw) -> RequestRouter:
    kw.setdefault("spill_ratio", None)  # placements exactly where the policy puts them (spill: its own test)
    cfg = DispatchConfig(cmlfq=dict(NOSTART), **kw)
    # groups given long-first: the router orders them by threshold, addresses follow their group
    return RequestRouter([LONG, SHORT], [addrs[1], addrs[0]], cfg, run_dir=tmp_path, health=False)


def tool(status: str, payload: int = 5) -> dict:
    return {"name": "calc", "payload_tokens": payload, "status": status}


def req(tid: str, ctx: int, tools: list[dict], prompt: str = "p0", model: int = 0) -> ModelRequest:
    meta = {"trajectory_id": tid, "prompt_id": prompt, "prompt_tokens": 10, "context_tokens": ctx,
            "model_tokens": model, "tool_returns": tools, "turn": len(tools)}
    return ModelRequest(input_ids=list(range(ctx)), metadata=meta)


def traj(tid: str, status: str, tail: int, step: int = 0, prompt: str = "p0") -> Trajectory:
    """Prompt 10, 20 generated, a calc return (5 tokens), then `tail` more generated tokens."""
    return Trajectory(tid, prompt, step, 10,
                      (Segment(20, ToolReturn("calc", 5, status)), Segment(tail)), "stop", 1.0)


def teach(router: RequestRouter, n: int = 6, step: int = 0) -> None:
    """A history where a successful calc return is followed by a long answer, a failed one by a short one."""
    for i in range(n):
        router.on_trajectory(traj(f"h{step}-s{i}", "success", 300, step))
        router.on_trajectory(traj(f"h{step}-f{i}", "failure", 10, step))
    router.step_metrics()  # step boundary: the step's trajectories become visible
    router.live.wait(10)


def run_turns(router: RequestRouter, tid: str, status: str) -> tuple[str, str]:
    r0 = req(tid, 10, [])
    a0 = router.route(r0, None)
    router.done(r0, a0, [1] * 20, "tool_calls")
    r1 = req(tid, 35, [tool(status)], model=20)
    a1 = router.route(r1, None)
    router.done(r1, a1, [1] * 7, "stop")
    return a0, a1


def test_tool_return_predicting_long_continuation_migrates_to_the_larger_group() -> None:
    router = make_router()
    teach(router)
    a0, a1 = run_turns(router, "t-long", "success")
    assert router.group_of[a0] == 0 and router.group_of[a1] == 1  # short -> long at the tool return
    b0, b1 = run_turns(router, "t-short", "failure")
    assert router.group_of[b0] == 0 and router.group_of[b1] == 0  # a failed call predicts a short answer
    m = router.step_metrics()
    assert m["cmlfq/migrations"] == 1 and m["cmlfq/migrated_tokens"] == 35
    assert m["cmlfq/requests/short"] == 3 and m["cmlfq/requests/long"] == 1
    assert m["cmlfq/inflight/short"] == 0 and m["cmlfq/inflight/long"] == 0
    assert m["cmlfq/tokens_per_s/long"] > 0


def test_without_history_nothing_moves_and_round_robin_policy_never_migrates() -> None:
    router = make_router()
    a0, a1 = run_turns(router, "t", "success")
    assert router.group_of[a0] == router.group_of[a1] == 0
    assert router.step_metrics()["cmlfq/migrations"] == 0
    rr = make_router(policy="least_loaded")
    teach(rr)
    starts = []
    for i in range(4):
        a0, a1 = run_turns(rr, f"t{i}", "success")
        assert a0 == a1  # placed once at the start, never moved
        starts.append(rr.group_of[a0])
    assert rr.step_metrics()["cmlfq/migrations"] == 0


def test_group_choice_holds_and_servers_are_least_loaded_inside_a_group() -> None:
    router = make_router()
    reqs = [req(f"t{i}", 10, []) for i in range(4)]
    addrs = [router.route(r, None) for r in reqs]
    # no history: everything starts in the short group, spread over its two servers by load
    assert sorted(addrs) == sorted(ADDRS[0] * 2)
    # the next turn of a trajectory without a new tool return stays on its server (sticky)
    router.done(reqs[0], addrs[0], [1], "stop")
    again = router.route(req("t0", 12, []), None)
    assert again == addrs[0]


def test_online_accuracy_is_scored_when_trajectories_finish() -> None:
    router = make_router()
    teach(router)
    run_turns(router, "a", "success")  # decisions: short (wrong: final 335 > 100), long (right)
    router.on_trajectory(traj("a", "success", 300, step=1))
    run_turns(router, "b", "failure")  # decisions: short, short (both right: final 45)
    router.on_trajectory(traj("b", "failure", 10, step=1))
    m = router.step_metrics()
    assert m["cmlfq/finished"] == 2
    assert m["cmlfq/decision_accuracy"] == pytest.approx(3 / 4)
    # tokens: a: 20 in the wrong bucket, 7 in the right one; b: 27 right
    assert m["cmlfq/token_accuracy"] == pytest.approx(34 / 54)


def test_requests_without_trajectory_metadata_still_go_through_the_dispatcher() -> None:
    router = make_router()
    r = ModelRequest(input_ids=[1, 2, 3])
    a = router.route(r, None)
    assert a in router.all_addresses
    router.done(r, a, [4], "stop")
    m = router.step_metrics()
    assert m["cmlfq/routed"] == 1 and m["cmlfq/inflight/short"] == 0
    assert router.dispatcher.placement(f"rid:{r.rid}") is None  # forgotten once done


def test_live_tree_rebuilds_off_path_saves_and_reloads_on_recover(tmp_path: Path) -> None:
    router = make_router(tmp_path)
    teach(router)
    assert (tmp_path / TREE_FILE).exists() and (tmp_path / WINDOW_FILE).exists()
    assert router.live.rebuilds == 1
    nodes = router.live.tree.node_count()
    assert nodes > 0
    # a fresh router for the same run directory (recover) picks the tree and its window up
    again = RequestRouter([SHORT, LONG], ADDRS, DispatchConfig(cmlfq=dict(NOSTART)), run_dir=tmp_path,
                          restore=True, health=False)
    assert again.restored and again.live.tree.node_count() == nodes
    a0, a1 = run_turns(again, "r", "success")
    assert again.group_of[a1] == 1  # the reloaded tree predicts like the saved one
    # the rebuild window came back too: a rebuild from it keeps the knowledge
    again.step_metrics()
    again.live.wait(10)
    assert again.live.tree.node_count() == nodes
    # without restore the same directory gives an empty tree
    cold = RequestRouter([SHORT, LONG], ADDRS, DispatchConfig(cmlfq=dict(NOSTART)), run_dir=tmp_path, health=False)
    assert not cold.restored and cold.live.tree.node_count() <= 1


def test_learning_during_a_rebuild_is_not_lost(tmp_path: Path) -> None:
    router = make_router(tmp_path)
    teach(router)
    before = router.live.tree.node_count()
    # a trajectory with a new state sequence arrives and becomes visible while no rebuild runs;
    router.on_trajectory(Trajectory("x", "p9", 1, 10, (Segment(5, ToolReturn("search", 5, "timeout")),
                                                        Segment(5)), "stop", 0.0))
    router.step_metrics()
    router.live.wait(10)
    assert router.live.tree.node_count() > before


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server API
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *a):
        pass


def _serve(port: int = 0) -> http.server.ThreadingHTTPServer:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Health)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def _dead_addr() -> str:
    return f"127.0.0.1:{free_port()}"


def test_failover_moves_a_request_off_a_dead_server_and_keeps_live_errors() -> None:
    live = _serve()
    live_addr = f"127.0.0.1:{live.server_address[1]}"
    dead = _dead_addr()
    try:
        router = make_router(addrs=[[dead, live_addr], [_dead_addr()]], health_timeout_s=1.0)
        r = req("t", 10, [])
        first = router.route(r, None)
        if first != dead:  # make the dead server the one in use
            router.done(r, first, [], "stop")
            router.dispatcher.begin(dead)
            first = dead
        new = asyncio.run(router.failover(r, first, ConnectionRefusedError("refused")))
        assert new == live_addr
        assert dead in router.down_addresses()
        assert router.step_metrics()["cmlfq/failovers"] == 1
        # a server that still answers /health: the error is not a server failure, it is raised again
        err = ValueError("bad request")
        with pytest.raises(ValueError, match="bad request"):
            asyncio.run(router.failover(r, live_addr, err))
        assert live_addr not in router.down_addresses()
        m = router.step_metrics()
        assert m["cmlfq/inflight/short"] == 0 and m["cmlfq/health_down"] == 0
    finally:
        live.shutdown()


def test_failover_falls_through_to_the_next_group_when_a_group_is_empty() -> None:
    dead = _dead_addr()
    router = make_router(addrs=[[dead], ["127.0.0.1:9"]], health_timeout_s=0.5)
    r = req("t", 10, [])
    assert router.route(r, None) == dead
    new = asyncio.run(router.failover(r, dead, ConnectionResetError()))
    assert new == "127.0.0.1:9" and router.step_metrics()["cmlfq/unhealthy_servers"] == 1


def test_one_watchdog_gives_up_on_every_request_of_a_down_server_only() -> None:
    # Many requests in flight on two servers: when one is marked down, each of its requests raises ServerDown
    # within a few intervals, the other server's finish with their results, and a cancel from above still
    # cancels the request (the watchdog converts only its own cancels).
    down, up = "127.0.0.1:2", "127.0.0.1:3"
    router = make_router(addrs=[[down, up], ["127.0.0.1:9"]], watch_interval_s=0.05)

    async def answer(i: int, after: float) -> int:
        await asyncio.sleep(after)
        return i

    async def main():
        on_down = [asyncio.ensure_future(router.watch(req(f"d{i}", 10, []), down, answer(i, 60))) for i in range(50)]
        on_up = [asyncio.ensure_future(router.watch(req(f"u{i}", 10, []), up, answer(i, 0.4))) for i in range(50)]
        stopped = asyncio.ensure_future(router.watch(req("c", 10, []), up, answer(-1, 60)))
        await asyncio.sleep(0.1)
        router.health.report_failure(down, "probe failed")
        t0 = time.monotonic()
        res = await asyncio.gather(*on_down, return_exceptions=True)
        gave_up = time.monotonic() - t0
        stopped.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stopped
        done = await asyncio.gather(*on_up)
        await asyncio.sleep(0.2)
        return res, gave_up, done, dict(router._watches)

    res, gave_up, done, left = asyncio.run(main())
    assert all(isinstance(e, ServerDown) for e in res) and gave_up < 1.0
    assert done == list(range(50))
    assert left == {}  # nothing in flight: the watchdog ended


def test_watch_gives_up_on_a_server_that_stops_answering() -> None:
    hang = socket.socket()
    hang.bind(("127.0.0.1", 0))
    hang.listen(8)  # accepts connections, never answers
    addr = f"127.0.0.1:{hang.getsockname()[1]}"
    router = make_router(addrs=[[addr, "127.0.0.1:2"], ["127.0.0.1:3"]], watch_interval_s=0.05)

    async def never():
        await asyncio.sleep(60)

    async def main():
        r = req("t", 10, [])
        threading.Timer(0.2, router.health.report_failure, (addr, "probe failed")).start()
        t0 = time.monotonic()
        with pytest.raises(ServerDown):
            await router.watch(r, addr, never())
        return time.monotonic() - t0

    try:
        assert asyncio.run(main()) < 2.0
        assert router.step_metrics()["cmlfq/health_down"] == 1
    finally:
        hang.close()


def test_health_probe_marks_down_and_readmits() -> None:
    srv = _serve()
    port = srv.server_address[1]
    addr = f"127.0.0.1:{port}"
    router = make_router(addrs=[[addr], ["127.0.0.1:3"]], fail_after=1, ok_after=1, health_timeout_s=0.5)
    mon = router.health
    mon.addresses = [addr]
    mon.check_once()
    assert addr not in router.down_addresses()
    srv.shutdown()
    srv.server_close()
    mon.check_once()
    assert addr in router.down_addresses()
    assert router.route(req("t", 10, []), None) == "127.0.0.1:3"  # the short group is empty: next group
    srv2 = _serve(port)
    try:
        # it missed a weight update while out: stays out
        class Engine:
            v = 0

            def get_version(self):
                return self.v

        eng = Engine()
        router.attach_engine(eng)
        router._version_down[addr] = 0
        eng.v = 1
        mon.check_once()
        assert addr in router.down_addresses()
        eng.v = 0
        mon.check_once()
        assert addr not in router.down_addresses()
        m = router.step_metrics()
        assert m["cmlfq/health_down"] == 1 and m["cmlfq/health_up"] == 1
    finally:
        srv2.shutdown()


def test_build_router_from_groups_file_and_from_config(tmp_path: Path, monkeypatch) -> None:
    groups = [RolloutGroup("short", 1, 2, max_len=80), RolloutGroup("long", 2, 1, max_len=160)]
    write_groups_file(tmp_path, groups, ["a:1", "a:2", "b:1"])
    libra = {"scheduler": {"policy": "cmlfq", "cmlfq": {"min_samples": 3}}}
    r = build_router(libra, tmp_path, health=False)
    assert r.group_addrs == [["a:1", "a:2"], ["b:1"]] and [g.max_len for g in r.groups] == [80, 160]
    assert r.dispatcher.policy.config.min_samples == 3
    other = tmp_path / "other"
    other.mkdir()
    monkeypatch.setenv("AREAL_LLM_SERVER_ADDRS", "x:1,y:1")
    libra2 = {"rollout_groups": [{"name": "s", "tp": 1}, {"name": "l", "tp": 2}], "scheduler": {"policy": "mlfq"}}
    r2 = build_router(libra2, other, max_tokens=100, health=False)
    assert r2.group_addrs == [["x:1"], ["y:1"]] and [g.max_len for g in r2.groups] == [50, 100]
    with pytest.raises(ValueError, match="polcy"):  # the typed config's one line (ConfigError)
        build_router({"scheduler": {"polcy": "cmlfq"}}, tmp_path, health=False)
    with pytest.raises(ValueError, match="min_sample"):
        build_router({"scheduler": {"cmlfq": {"min_sample": 3}}}, tmp_path, health=False)
    with pytest.raises(ValueError, match="2 servers but 3"):
        build_router(libra2, other, addresses=["a", "b", "c"], max_tokens=100, health=False)
    assert json.loads((tmp_path / "rollout_groups.json").read_text())["groups"][1]["addresses"] == ["b:1"]


def test_single_controller_router_travels_over_areal_rpc_serialization(tmp_path: Path) -> None:
    from areal.infra.rpc.serialization import deserialize_value, serialize_value
    from omegaconf import OmegaConf

    from areal_libra.rollout.router import RemoteRouter

    groups = [RolloutGroup("short", 1, 2, max_len=80), RolloutGroup("long", 2, 1, max_len=160)]
    write_groups_file(tmp_path, groups, ["a:1", "a:2", "b:1"])
    libra = OmegaConf.create({"scheduler": {"policy": "cmlfq", "cmlfq": {"start_lookup": False},
                                            "health_interval_s": 60}})
    spec = RemoteRouter.from_groups_file(tmp_path, libra)
    wire = json.loads(json.dumps(serialize_value({"router": spec})))  # what the RPC body carries
    worker_side = deserialize_value(wire)["router"]
    assert isinstance(worker_side, RemoteRouter) and worker_side == spec
    # on the worker it routes over all groups, not only the worker's own server
    r = req("t", 10, [])
    a = worker_side.route(r, ["b:1"])
    assert a in ("a:1", "a:2")
    worker_side.done(r, a, [1, 2], "stop")
    inner = worker_side._get()
    assert inner.step_metrics()["cmlfq/requests/short"] == 1
    assert inner.run_dir.parent == tmp_path and inner.run_dir.name.startswith("router-")
    inner.close()


def test_mean_inflight_per_group_is_time_weighted() -> None:
    router = make_router()
    clock = time.monotonic
    s0 = clock()
    router.step_metrics()
    s1 = clock()
    reqs = [req(f"t{i}", 10, []) for i in range(2)]
    a0 = clock()
    addrs = [router.route(r, None) for r in reqs]
    a1 = clock()
    time.sleep(0.3)
    d0 = clock()
    for r, a in zip(reqs, addrs):
        router.done(r, a, [1], "stop")
    d1 = clock()
    time.sleep(0.3)
    e0 = clock()
    m = router.step_metrics()
    e1 = clock()
    # two requests in flight from routing to done, over the window between the two step_metrics calls
    # (bounds from the clock readings around each call, so a loaded machine's late wake-ups do not matter)
    low, high = 2 * (d0 - a1) / (e1 - s0), 2 * (d1 - a0) / (e0 - s1)
    assert low - 0.01 <= m["cmlfq/inflight_mean/short"] <= high + 0.01
    assert m["cmlfq/inflight_mean/long"] == 0 and m["cmlfq/inflight/short"] == 0


class _Control(http.server.BaseHTTPRequestHandler):
    """Answers /health and any POST control call with {} (what AReaL needs from pause/continue)."""

    def do_GET(self):  # noqa: N802 - http.server API
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):  # noqa: N802 - http.server API
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = b"{}"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


def test_control_requests_take_a_dead_server_out_instead_of_failing() -> None:
    from areal.api.cli_args import InferenceEngineConfig
    from areal.engine.sglang_remote import RemoteSGLangEngine

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Control)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    live, dead = f"127.0.0.1:{srv.server_address[1]}", _dead_addr()
    try:
        eng = RemoteSGLangEngine(InferenceEngineConfig(experiment_name="c", trial_name="t", request_timeout=5,
                                                       request_retries=1))
        eng._engine.addresses = [live, dead]
        with pytest.raises(RuntimeError):  # AReaL's behaviour without a router: a dead server fails the call
            eng.continue_generation()
        router = make_router(addrs=[[live], [dead]], health_timeout_s=1.0)
        eng.set_request_router(router)
        eng.continue_generation()  # the dead server is taken out, the live one still gets the call
        assert router.down_addresses() == {dead}
        assert eng._engine._serving_addresses() == [live]
        # a server that failed a weight update stays out even when it answers again
        router.weights_failed([live])
        router.health.addresses = [live]
        router.health.check_once()
        router.health.check_once()
        assert live in router.down_addresses()
    finally:
        srv.shutdown()


def test_set_layout_switches_placement_keeps_the_tree_and_drains_retired_servers() -> None:
    """A reconfiguration (areal_libra.rollout.fleet): new placements go to the new layout only, the
    learned tree carries over, in-flight requests on a retired server are counted until done, and an evicted
    one gives up at once (it resumes elsewhere through failover)."""
    router = make_router()
    teach(router)
    tree = router.dispatcher.policy.tree
    r = req("t-old", 10, [])
    old = router.route(r, None)
    assert old in ("127.0.0.1:1", "127.0.0.1:2") and router.inflight(old) == 1
    keep = "127.0.0.1:2" if old == "127.0.0.1:1" else "127.0.0.1:1"
    left = router.set_layout([RolloutGroup("short", tp=1, count=1, max_len=150), RolloutGroup("big", tp=4, max_len=400)],
                             [[keep], ["127.0.0.1:7"]])
    assert sorted(left) == sorted([old, "127.0.0.1:3"])
    assert router.dispatcher.policy.tree is tree and [g.max_len for g in router.dispatcher.groups] == [150, 400]
    assert router.all_addresses == [keep, "127.0.0.1:7"] and set(router.health.addresses) == {keep, "127.0.0.1:7",
                                                                                              old, "127.0.0.1:3"}
    # the old trajectory's next turn and new trajectories land in the new layout; a successful calc return
    # still predicts a long answer (same tree): the big group
    r1 = req("t-old", 35, [tool("success")], model=20)
    assert router.route(r1, None) == "127.0.0.1:7"
    assert {router.route(req(f"n{i}", 10, []), None) for i in range(4)} == {keep}
    # its group "short" is in both layouts: the move to "big" at the tool return is a real migration
    assert router.step_metrics()["cmlfq/migrations"] == 1
    # the first request is still on the retired server: counted until done
    assert router.inflight(old) == 1
    router.done(r, old, [1] * 5, "stop")
    assert router.inflight(old) == 0 and router.totals()["group_tokens"]["short"] == 5

    async def never():
        await asyncio.sleep(60)

    r2 = req("t-2", 10, [])
    router._begin(old)  # a request placed just before the switch
    router.evict([old])

    async def main():
        t0 = time.monotonic()
        with pytest.raises(ServerDown):
            await router.watch(r2, old, never())
        return time.monotonic() - t0

    assert asyncio.run(main()) < 2.0
    assert asyncio.run(router.failover(r2, old, ServerDown(old))) == keep
    assert router.inflight(old) == 0
    router.forget([old, "127.0.0.1:3"])
    assert set(router.health.addresses) == {keep, "127.0.0.1:7"}
    with pytest.raises(ValueError, match="still in the layout"):
        router.forget([keep])


def test_fallback_fraction_is_reported_and_a_wrong_cmlfq_falls_back_to_least_loaded() -> None:
    from areal_libra.cmlfq.policy import FALLBACK_MIN_DECISIONS

    router = make_router()
    teach(router)  # a successful calc return -> long answer
    m = router.step_metrics()
    assert m["cmlfq/fallback_fraction"] is None and m["cmlfq/fallback_active"] == 0  # nothing routed yet
    # Now every trajectory ends short after a successful call: C-MLFQ moves each to "long", wrongly.
    n = FALLBACK_MIN_DECISIONS // 2 + 1
    for i in range(n):
        a0, a1 = run_turns(router, f"w{i}", "success")
        assert router.group_of[a1] == 1  # moved to the long group
        router.on_trajectory(traj(f"w{i}", "success", 2, step=1))
    m = router.step_metrics()  # the step boundary scores them: accuracy 1/2, the fallback's 1/2 too
    assert m["cmlfq/fallback_fraction"] == 0.0 and m["cmlfq/fallback_active"] == 1
    a0, a1 = run_turns(router, "x", "success")
    assert a1 == a0  # least-loaded inside the groups, no move
    m = router.step_metrics()
    assert m["cmlfq/fallback_fraction"] == 1.0 and m["cmlfq/migrations"] == 0


def test_set_pricing_installs_the_cost_evaluators_price_in_this_and_the_next_layout() -> None:
    from areal_libra.cost import load_cluster, load_model

    router = make_router()
    assert router.dispatcher.policy.pricer is None
    router.set_pricing(load_cluster("a800x48").hardware, load_model("qwen3-14b"))
    assert router.dispatcher.policy.pricer.tps == (1, 2)
    router.set_layout([SHORT, LONG], ADDRS)
    assert router.dispatcher.policy.pricer.tps == (1, 2)


def test_placements_spill_to_the_idle_neighbour_bucket_as_in_the_simulator() -> None:
    # Every new request predicted short (an empty tree): without spill-over they all pile on the short group's
    # one server while the long group idles; with the simulator's spill ratio (1.2) they spread once the short
    # group's load per GPU passes 1.2 x the long one's + 1.
    def place(ratio):
        router = make_router(spill_ratio=ratio)
        return [router.route(req(f"s{i}", 10, []), None) for i in range(12)]

    assert all(a in ADDRS[0] for a in place(None))
    spread = place(1.2)
    assert any(a in ADDRS[1] for a in spread) and any(a in ADDRS[0] for a in spread)


class _Engine:
    def __init__(self) -> None:
        self.version = 3

    def get_version(self) -> int:
        return self.version


@pytest.mark.parametrize("oldest_first", [True, False])
def test_requests_carry_their_trajectorys_start_version_as_priority(oldest_first: bool) -> None:
    """LibraConfig.bound_lag: every request of a trajectory is sent with the weight version its first
    request saw (cmlfq.aging.priority; patch 15 puts it into SGLang's payload); off, no priority."""
    cfg = DispatchConfig(cmlfq=dict(NOSTART), spill_ratio=None)
    router = RequestRouter([LONG, SHORT], [ADDRS[1], ADDRS[0]], cfg, health=False, oldest_first=oldest_first)
    engine = _Engine()
    router.attach_engine(engine)
    r0 = req("t1", 10, [])
    router.done(r0, router.route(r0, None), [1] * 20, "tool_calls")
    engine.version = 5  # a weight update while t1 waits for its tool
    r1 = req("t1", 35, [tool("success")], model=20)
    router.route(r1, None)
    r2 = req("t2", 10, [])
    router.route(r2, None)
    got = [r.metadata.get("priority") for r in (r0, r1, r2)]
    assert got == ([3, 3, 5] if oldest_first else [None, None, None])


def test_the_working_set_is_the_running_trajectories_contexts() -> None:
    """Libra's admission (live/admission.py) counts each running trajectory's context: its last request's input
    plus what that request generated, whether it decodes or waits on a tool; a finished one leaves the set."""
    from areal_libra.live.admission import WorkingSetGate

    router = make_router()
    r0 = req("a", 10, [])
    a0 = router.route(r0)
    router.route(req("b", 30, []))
    assert router.working_tokens() == 40
    router.done(r0, a0, [1] * 20, "tool_calls")  # "a" waits on its tool with 30 tokens of context
    assert router.working_tokens() == 60
    r1 = req("a", 35, [tool("success")])  # back with a 5-token payload: the request's input is the context
    a1 = router.route(r1)
    router.done(r1, a1, [1] * 7, "stop")
    assert router.working_tokens() == 42 + 30
    router.on_trajectory(Trajectory("a", "p0", 0, 10, (Segment(20, ToolReturn("calc", 5, "success")), Segment(7)),
                                    "stop", 1.0))
    assert router.working_tokens() == 30
    gate = WorkingSetGate(router.working_tokens, lambda: 31)
    assert gate() and gate.held == 0
    gate.kv_capacity = lambda: 30
    assert not gate() and gate.metrics() == {"libra/admission_held_polls": 1.0}
    gate.kv_capacity = lambda: 0
    assert gate()  # no server reports its KV size: nothing is held back


def test_a_trajectory_past_the_lag_bound_leaves_the_working_set() -> None:
    """One whose workflow failed never reaches the sink: more than max_lag versions after it started it no longer
    counts (the trainer has taken every trajectory that old under the lag bound)."""

    class Engine:
        v = 3

        def get_version(self) -> int:
            return self.v

    router = make_router()
    engine = Engine()
    router.attach_engine(engine)
    router.route(req("old", 50, []))
    engine.v = 5
    router.route(req("new", 20, []))
    assert router.working_tokens() == 70 and router.working_tokens(max_lag=2) == 70
    engine.v = 6
    assert router.working_tokens(max_lag=2) == 20
