"""One rollout pressure (elastic/measure.py): the tighter of request slots and KV tokens in use, the share of
requests not admitted yet; the live sampler (rollout/pressure.py, a server's /server_info) and the simulator
(its RolloutServer's state) reduce the same counts with the same function."""

from __future__ import annotations

import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from areal_libra.elastic.measure import Pressure, ServerLoad, mean_pressure, pressure
from areal_libra.rollout.pressure import PressureSampler, server_load
from areal_libra.sim.hardware import truth_for
from areal_libra.sim.server import RolloutServer, SimRequest
from areal_libra.trace import Segment, Trajectory


def test_active_pressure_is_the_tighter_of_slots_and_kv():
    # slots bind: 48 of 64 running, a quarter of the KV cache in use
    assert pressure([ServerLoad(48, 0, 64, 1000, 4000)]) == Pressure(0.0, 0.75)
    # KV binds: 8 of 64 running, but their contexts fill 90% of the KV cache; 8 more wait
    assert pressure([ServerLoad(8, 8, 64, 3600, 4000)]) == Pressure(0.5, 0.9)
    # summed over the servers: (8 + 24) slots of 64 + 64; KV (3600 + 400) of 8000
    assert pressure([ServerLoad(8, 0, 64, 3600, 4000), ServerLoad(24, 0, 64, 400, 4000)]) == Pressure(0.0, 0.5)
    # a server that does not report its KV counts by slots only (its zero is not averaged into the KV term)
    assert pressure([ServerLoad(8, 0, 64, 3600, 4000), ServerLoad(8, 0, 64)]) == Pressure(0.0, 0.9)
    assert pressure([ServerLoad(64, 0, 64, 5000, 4000)]).active == 1.0  # capped
    assert pressure([]) == Pressure(0.0, 0.0)


def test_a_steps_pressure_is_the_mean_of_its_samples():
    assert mean_pressure([Pressure(0.5, 1.0), Pressure(0.0, 0.5)]) == Pressure(0.25, 0.75)
    assert mean_pressure([]) == Pressure(0.0, 0.0)


def test_server_info_fields():
    info = {"num_running_requests": 3, "num_waiting_requests": 1, "max_running_requests": 16,
            "num_used_tokens": 700, "max_total_num_tokens": 1000}
    assert server_load(info) == ServerLoad(3, 1, 16, 700, 1000)
    # SGLang reports its KV capacity but not the tokens in use: slots only
    del info["num_used_tokens"]
    assert server_load(info) == ServerLoad(3, 1, 16, 0, 0)


def _busy_sim_server() -> RolloutServer:
    """A simulated TP1 server mid-run: long contexts admitted until the KV cache is nearly full, the rest
    queued, a few decode iterations done."""
    s = RolloutServer(0, 1, 0, truth_for("a800", "qwen3-14b"), random.Random(0))
    for i in range(64):
        traj = Trajectory(f"t{i}", "p", 0, 20000, (Segment(4000, None),))
        s.enqueue(SimRequest(traj, None, 0, 0.0), 0, 20000)
    end, _ = s.start_chunk(0.0)
    s.interrupt(end / 2)
    assert s.batch > 0 and s.queue and s.kv() > 0  # a state with all three terms
    return s


def _serve_info(info: dict) -> ThreadingHTTPServer:
    """A loopback server answering /server_info (any GET) with `info`, SGLang's field names."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            body = json.dumps(info).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def test_the_live_sampler_and_the_simulator_give_the_same_pressure_for_one_server_state():
    sim = _busy_sim_server()
    # The same state as a live server reports it (SGLang's /server_info field names), over loopback HTTP.
    info = {"num_running_requests": sim.batch, "num_waiting_requests": len(sim.queue),
            "max_running_requests": sim.max_running, "num_used_tokens": sim.kv(),
            "max_total_num_tokens": sim.capacity}

    httpd = _serve_info(info)
    sampler = PressureSampler(lambda: [f"127.0.0.1:{httpd.server_address[1]}"], interval_s=3600)
    try:
        live = sampler.sample()
    finally:
        sampler.close()
        httpd.shutdown()
    simulated = pressure([sim.server_load()])
    assert live == simulated
    # KV binds on this server (long contexts), not its 512 request slots
    assert simulated.active == pytest.approx(sim.kv() / sim.capacity) and simulated.active > sim.batch / 512
    assert simulated.queue == pytest.approx(len(sim.queue) / (len(sim.queue) + sim.batch))


def test_the_simulator_records_the_shared_pressure_of_its_servers():
    from areal_libra.sim.cluster import Controller, Simulation
    from areal_libra.sim.registry import build_system
    from areal_libra.sim.report import make_env, parse_knobs

    class Check(Controller):  # called with the step's record, the servers still in the recorded state
        seen: list = []

        def on_step_end(self, sim: Simulation, rec: dict) -> None:
            self.seen.append((pressure(s.server_load() for s in sim.servers),
                              Pressure(rec["queue_pressure"], rec["active_pressure"])))

    env = make_env("dapo_math", "a800x48", "qwen3-14b", 3, 4, 8, parse_knobs([]))
    spec = build_system("areal_static_optimal", env)
    sim = Simulation(env.truth, env.workload, env.n_gpus, spec.layout, spec.run, spec.router_factory(spec.layout),
                     Check(), seed=env.seed)
    sim.run(4)
    assert len(Check.seen) == 4 and all(want == got for want, got in Check.seen)
    assert any(got.active > 0 for _, got in Check.seen)


def test_an_embedded_server_reports_the_kv_tokens_the_sampler_reads(tiny_model_dir):
    from areal_libra.server.inprocess import InProcessServer, http

    srv = InProcessServer(tiny_model_dir, max_running_requests=16, max_total_tokens=256, seed=0)
    ids = srv.tokenizer.encode("What is 12+30? ")
    threads = [threading.Thread(target=http, args=(srv.addr, "/generate", {
        "input_ids": ids, "rid": f"r{i}", "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}))
        for i in range(3)]
    sampler = PressureSampler(lambda: [srv.addr], interval_s=3600, timeout_s=10.0)
    try:
        for t in threads:
            t.start()
        deadline = time.time() + 60
        while srv.engine.num_used_tokens() < 120:  # the three contexts hold about half of the 256 tokens
            assert time.time() < deadline, "requests did not grow"
            time.sleep(0.01)
        assert http(srv.addr, "/pause_generation", {"mode": "in_place"})[0] == 200  # freeze the state
        running, held = srv.engine.num_running(), srv.engine.num_used_tokens()
        p = sampler.sample()
        assert p == Pressure(srv.engine.num_waiting() / max(1, srv.engine.num_waiting() + running),
                             max(running / 16, held / 256))
        assert p.active == held / 256 > running / 16  # the KV term binds with these long contexts
    finally:
        sampler.close()
        http(srv.addr, "/continue_generation", {})
        http(srv.addr, "/abort_request", {"abort_all": True})
        for t in threads:
            t.join(30)
        srv.close()


def test_the_sampler_leaves_the_lent_servers_out_of_the_kv_capacity():
    # Two servers answering /server_info over loopback; one is an elastic hybrid's (lent): it is sampled for
    # pressure but its KV is not the working-set admission's to count on.
    def serve(capacity: int) -> ThreadingHTTPServer:
        return _serve_info({"num_running_requests": 1, "num_waiting_requests": 0, "max_running_requests": 8,
                            "num_used_tokens": 10, "max_total_num_tokens": capacity})

    core, hybrid = serve(1000), serve(300)
    addrs = [f"127.0.0.1:{h.server_address[1]}" for h in (core, hybrid)]
    lent: set[str] = set()
    sampler = PressureSampler(lambda: addrs, interval_s=3600, lent=lambda: lent)
    try:
        both = sampler.sample()
        assert sampler.kv_capacity() == 1300
        lent.add(addrs[1])
        assert sampler.sample() == both  # the pressure still reads every serving server
        assert sampler.kv_capacity() == 1000
    finally:
        sampler.close()
        core.shutdown()
        hybrid.shutdown()


def test_the_sampler_keeps_the_servers_queue_for_the_controllers_backlog():
    # Two real HTTP servers with 3 and 5 requests queued: the last sample's queue is their sum (LiveControl's
    # backlog_fn divides it by the batch); a server that stops answering leaves the queue of those that do.
    def serve(waiting: int) -> ThreadingHTTPServer:
        return _serve_info({"num_running_requests": 2, "num_waiting_requests": waiting, "max_running_requests": 8})

    from areal_libra.control import ControlConfig
    from areal_libra.live.live_cluster import LiveCluster, LiveControl

    a, b = serve(3), serve(5)
    addrs = [f"127.0.0.1:{h.server_address[1]}" for h in (a, b)]
    sampler = PressureSampler(lambda: addrs, interval_s=3600, timeout_s=2.0)
    ctl = LiveControl(ControlConfig(), None, LiveCluster(None))
    try:
        assert sampler.waiting() == 0 and ctl.backlog_batches() == 0.0  # no source: none measured
        sampler.sample()
        assert sampler.waiting() == 8
        ctl.backlog_fn = lambda: sampler.waiting() / 4  # a batch of 4 trajectories: 2 batches queued
        assert ctl.backlog_batches() == 2.0
        b.shutdown()
        b.server_close()
        sampler.sample()
        assert sampler.waiting() == 3
    finally:
        sampler.close()
        a.shutdown()
