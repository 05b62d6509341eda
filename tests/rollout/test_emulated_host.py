"""The emulated host (areal_libra/rollout/emulated_host.py): one real host process, its servers started and
stopped through EmulatedHostBackend, request timing against the hardware truth computed here independently
(prefill + one decode iteration per token over the growing KV), abort/resume progress, weight sync."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest
import torch

from areal_libra.rollout.emulated_host import REAL_TOKENS, emulated_rid, launch_host, parse_rid
from areal_libra.rollout.emulation import _batch_lengths, emulated_truth, pacing_error, stand_in_batch
from areal_libra.rollout.launcher import ServerSpec

SCALE = 0.5


def _post(addr: str, path: str, body: dict, timeout: float = 60.0) -> dict:
    req = urllib.request.Request(f"http://{addr}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    return json.loads(raw) if raw.strip() else {}


def _gen(addr: str, rid: str, n: int) -> tuple[float, dict]:
    t0 = time.perf_counter()
    out = _post(addr, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": n}, "rid": rid})
    return time.perf_counter() - t0, out


def _single_request_s(truth, tp: int, ctx: int, n: int) -> float:
    return truth.prefill_s(tp, ctx) + sum(truth.decode_iteration_s(tp, 1, ctx + i) for i in range(n))


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    backend, proc = launch_host("qwen3-14b", "h200", SCALE, tmp_path_factory.mktemp("host"))
    yield backend
    proc.terminate()
    proc.wait(timeout=10)


def test_rid_round_trip():
    rid = emulated_rid("u", "traj~1", 1234, False)
    assert parse_rid(rid, 3) == ("traj-1", 1234, False)
    assert parse_rid("plain-id", 7) == ("plain-id", 7, True)


def test_batch_lengths_prefer_emulated_tokens():
    batch = {"attention_mask": torch.ones(2, 5, dtype=torch.bool), "emul_tokens": torch.tensor([900, 4000])}
    assert _batch_lengths(batch) == [900, 4000]
    assert _batch_lengths({"attention_mask": torch.ones(2, 5, dtype=torch.bool)}) == [5, 5]
    assert pacing_error(1.0, 20.0) == 0.05 and pacing_error(0.0, 0.0) == 0.0


def test_stand_in_batch_slices_the_batch_dimension():
    batch = {"input_ids": torch.zeros(32, 7), "attention_mask": torch.ones(32, 7), "rewards": torch.ones(32),
             "scalar": torch.tensor(3.0), "meta": "x"}
    small = stand_in_batch(batch, 4)
    assert small["input_ids"].shape == (4, 7) and small["rewards"].shape == (4,)
    assert small["scalar"].item() == 3.0 and small["meta"] == "x"
    assert stand_in_batch(batch, 64) is batch
    trajs = [{"input_ids": torch.zeros(1, 3)} for _ in range(10)]
    assert len(stand_in_batch(trajs, 4)) == 4 and stand_in_batch(trajs, 10) is trajs


def test_servers_paced_to_the_truth(host):
    truth = emulated_truth("qwen3-14b", "h200")
    h1, h2 = host.start("unused", [ServerSpec(tp=1, group="a"), ServerSpec(tp=2, group="b")], "", weight_version=3)
    try:
        assert h1.alive() and h2.alive()
        info = json.loads(urllib.request.urlopen(f"http://{h1.addr}/model_info", timeout=10).read())
        assert info["weight_version"] == "3"
        measured = {}
        for h, tp in ((h1, 1), (h2, 2)):
            dt, out = _gen(h.addr, emulated_rid("u", f"t{tp}", 2000, True), 600)
            assert out["meta_info"]["completion_tokens"] == 600
            assert len(out["output_ids"]) == REAL_TOKENS
            want = SCALE * _single_request_s(truth, tp, 2000, 600)
            # the server's persistent speed factor (sigma 0.03) and per-chunk noise stay within 12%
            assert want * 0.88 <= dt <= want * 1.12 + 0.15, (tp, dt, want)
            measured[tp] = dt
        ratio = _single_request_s(truth, 1, 2000, 600) / _single_request_s(truth, 2, 2000, 600)
        assert ratio > 1.2
        assert measured[1] / measured[2] == pytest.approx(ratio, rel=0.15)
        p = host.pacing()
        assert p["chunks"] >= 2 and p["pacing_error"] < 0.10
    finally:
        host.stop(h1)
        host.stop(h2)
    assert not h1.alive()


def test_batch_shares_iterations(host):
    """16 concurrent requests on one server take about the time of one batched run, not 16 serial ones."""
    truth = emulated_truth("qwen3-14b", "h200")
    [h] = host.start("unused", [ServerSpec(tp=1)], "")
    try:
        times: list[float] = []
        ths = [threading.Thread(target=lambda i=i: times.append(_gen(h.addr, emulated_rid(f"u{i}", f"b{i}", 500, True),
                                                                        300)[0])) for i in range(16)]
        t0 = time.perf_counter()
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        wall = time.perf_counter() - t0
        serial = SCALE * 16 * _single_request_s(truth, 1, 500, 300)
        batched = SCALE * sum(truth.decode_iteration_s(1, 16, 16 * (500 + i)) for i in range(300))
        assert len(times) == 16
        assert batched * 0.85 <= wall < serial * 0.5, (wall, batched, serial)
    finally:
        host.stop(h)


def test_abort_keeps_progress_and_weight_sync(host):
    truth = emulated_truth("qwen3-14b", "h200")
    [h] = host.start("unused", [ServerSpec(tp=1)], "")
    try:
        rid = emulated_rid("u", "ab", 1000, True)
        res: dict = {}
        th = threading.Thread(target=lambda: res.update(_gen(h.addr, rid, 2000)[1]))
        th.start()
        full = SCALE * _single_request_s(truth, 1, 1000, 2000)
        time.sleep(full * 0.6)
        _post(h.addr, "/pause_generation", {})
        th.join(timeout=10)
        assert res["meta_info"]["finish_reason"]["type"] == "abort" and res["output_ids"] == []
        t0 = time.perf_counter()
        r = _post(h.addr, "/update_weights_from_disk", {"model_path": "/x/weight_update_v7"})
        sync = time.perf_counter() - t0
        assert r["success"] and sync >= SCALE * truth.weight_sync_s(1) * 0.95
        assert json.loads(urllib.request.urlopen(f"http://{h.addr}/model_info", timeout=10).read())["weight_version"] == "7"
        _post(h.addr, "/continue_generation", {})
        dt, out = _gen(h.addr, rid, 2000)  # AReaL's client sends it again: only the rest is generated
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
        assert dt < full * 0.6, (dt, full)
    finally:
        host.stop(h)


def test_rollout_busy_share_measured_from_the_host(host):
    """The trainer's per-step rollout busy share (LiveControl.rollout_busy over the host's GET /pacing) is the
    servers' busy accelerator-seconds over the interval x the accelerators serving: one request on one of two
    TP2 servers keeps a quarter of the rollout accelerators busy while it runs, nothing while idle; a stopped
    server's busy time is kept."""
    from areal_libra.control import ControlConfig
    from areal_libra.live.live_cluster import LiveCluster, LiveControl

    truth = emulated_truth("qwen3-14b", "h200")
    ctl = LiveControl(ControlConfig(), None, LiveCluster(None))
    assert ctl.rollout_busy() is None  # no source: not measured
    serving0 = host.pacing()["serving_gpus"]
    hs = host.start("unused", [ServerSpec(tp=2), ServerSpec(tp=2)], "")
    try:
        ctl.busy_fn = host.pacing
        assert ctl.rollout_busy() is None  # the first reading only starts the clock
        busy0 = host.pacing()["busy_gpu_s"]
        t0 = time.perf_counter()
        _gen(hs[0].addr, emulated_rid("u", "busy", 2000, True), 400)
        share = ctl.rollout_busy()
        wall = time.perf_counter() - t0
        busy = SCALE * _single_request_s(truth, 2, 2000, 400) * 2  # real seconds x TP2
        assert host.pacing()["busy_gpu_s"] - busy0 == pytest.approx(busy, rel=0.05)
        assert share == pytest.approx(busy / (wall * 4), rel=0.2) and 0.15 < share < 0.5, (share, busy, wall)
        time.sleep(0.5)
        assert ctl.rollout_busy() == pytest.approx(0.0, abs=0.01)  # idle servers
    finally:
        for h in hs:
            host.stop(h)
    assert host.pacing()["serving_gpus"] == serving0  # stopped through the control API (host.stop hides errors)
    assert host.pacing()["busy_gpu_s"] - busy0 == pytest.approx(busy, rel=0.05)  # retired servers' time stays


def test_a_busy_reading_mid_generation_counts_the_time_so_far(host):
    """One long request is one decode chunk (it runs until the request ends); a reading of the host's busy time
    half-way through counts the half that has run (a step's end does not wait for the servers' chunks)."""
    truth = emulated_truth("qwen3-14b", "h200")
    hs = host.start("unused", [ServerSpec(tp=1)], "")
    try:
        busy0 = host.pacing()["busy_gpu_s"]
        full = SCALE * _single_request_s(truth, 1, 2000, 800)  # real seconds (TP1)
        th = threading.Thread(target=_gen, args=(hs[0].addr, emulated_rid("u", "mid", 2000, True), 800))
        t0 = time.perf_counter()
        th.start()
        time.sleep(full / 2)
        mid, elapsed = host.pacing()["busy_gpu_s"] - busy0, time.perf_counter() - t0
        th.join()
        assert 0.6 * (full / 2) < mid <= 1.05 * elapsed, (mid, full, elapsed)
        assert host.pacing()["busy_gpu_s"] - busy0 == pytest.approx(full, rel=0.05)
    finally:
        for h in hs:
            host.stop(h)


class _Metrics:
    def __init__(self) -> None:
        self.sources, self.hooks = [], []

    def add_source(self, fn) -> None:
        self.sources.append(fn)

    def add_step_hook(self, fn) -> None:
        self.hooks.append(fn)


def test_train_pacing_window_stand_in_and_error():
    """The paced window opens at compute_advantages; the real update sees the stand-in slice; the pacing
    counts the whole batch; emul/pacing_error is the larger of the trainer's and the host's."""
    from types import SimpleNamespace

    from areal_libra.rollout.emulation import ClusterEmulation, configure, install_train_pacing
    from areal_libra.rollout.groups import RolloutGroup

    seen = {}

    class Actor:
        def compute_advantages(self, batch):
            time.sleep(0.3)  # longer than the target below: an overrun
            return batch

        def ppo_update(self, batch):
            seen["n"] = len(batch)

    trainer = SimpleNamespace(actor=Actor())
    emu = ClusterEmulation(accelerators=16, time_scale=1e-4)
    m = _Metrics()
    install_train_pacing(trainer, emu, lambda: [RolloutGroup("g", 1, 4)], m, host_pacing_fn=lambda: {"pacing_error": 0.05},
                         train_sample=3)
    try:
        batch = [{"emul_tokens": torch.tensor([5000])} for _ in range(8)]
        trainer.actor.ppo_update(trainer.actor.compute_advantages(batch))
        out = m.sources[0]()
    finally:
        configure(None)
    assert seen["n"] == 3
    target = emu.train_target_s([5000] * 8, 12)
    assert out["emul/train_target_s"] == pytest.approx(target)
    assert out["emul/train_compute_s"] >= 0.3 > target
    assert out["emul/train_pacing_error"] == pytest.approx((out["emul/train_compute_s"] - target) / target)
    assert out["emul/pacing_error"] == out["emul/train_pacing_error"] > 0.05


def test_host_runs_the_elastic_pool_sized_with_the_plan_only():
    from areal_libra.rollout.emulation import ClusterEmulation, EmulationError

    ok = ClusterEmulation.from_libra({"emulated": {"enabled": True, "host": True}})
    assert ok is not None and ok.accelerators == 16
    with pytest.raises(EmulationError, match="sized with the plan only"):
        ClusterEmulation.from_libra({"emulated": {"enabled": True, "host": True}, "elastic": {"enabled": True}})
    pool = ClusterEmulation.from_libra({"emulated": {"enabled": True, "host": True},
                                        "elastic": {"enabled": True, "size_with_plan": True}})
    assert pool is not None and pool.hybrid_accelerators == 0  # its hybrids are inside the plan
