"""Calibration recovers known efficiency factors from samples, EMA tracks drift, and the profiler runs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from areal_libra.cost.calibrate import Calibration
from areal_libra.cost.presets import ClusterSpec, load_hardware, load_model
from areal_libra.cost.rollout import RolloutCost
from areal_libra.cost.training import TrainCost, TrainParallel

ROOT = Path(__file__).resolve().parents[2]


def test_least_squares_recovers_truth():
    start = load_hardware("a800")
    m = load_model("qwen3-4b")
    # "truth": 25% slower HBM/decode compute, 3 ms step overhead, prefill at 40% MFU + 8 ms, training at 30%.
    truth = start.replace(hbm_eff=start.hbm_eff * 0.75, decode_mfu=start.decode_mfu * 0.75, step_overhead_s=3e-3,
                          prefill_mfu=0.40, prefill_overhead_s=8e-3, train_mfu=0.30)
    cal = Calibration(start, m)
    for tp in (1, 2):
        rc = RolloutCost(truth, m, tp)
        for b, kv in ((1, 1000), (8, 20000), (64, 200000), (256, 50000)):
            cal.add_decode(tp, b, kv, float(rc.decode_step_s(b, kv)))
        for n in (1024, 4096, 8192):  # compute bound (the fit scales prefill_mfu only)
            cal.add_prefill(tp, n, float(rc.prefill_s(n)))
    tc = TrainCost(ClusterSpec(truth, 1, 8), m)
    for par, lens in ((TrainParallel(1, 1, 1), [4096] * 4), (TrainParallel(1, 1, 1, 1, 2), [8192] * 8)):
        cal.add_train(par, lens, tc.step_time_s(par, lens))
    res = cal.fit()
    hw = res.hardware
    assert hw.hbm_eff == pytest.approx(truth.hbm_eff, rel=1e-6)
    assert hw.decode_mfu == pytest.approx(truth.decode_mfu, rel=1e-6)
    assert hw.step_overhead_s == pytest.approx(3e-3, rel=1e-5)
    assert hw.prefill_mfu == pytest.approx(0.40, rel=1e-6)
    assert hw.prefill_overhead_s == pytest.approx(8e-3, rel=1e-5)
    assert hw.train_mfu == pytest.approx(0.30, rel=0.01)  # optimizer/comm parts do not scale with MFU
    assert max(res.rel_error.values()) < 0.01


def test_decode_regimes_and_per_request_overhead_are_fitted_separately():
    """Memory-bound and compute-bound decode scale independently, plus a per-running-request overhead."""
    start = load_hardware("a800")
    m = load_model("qwen3-14b")
    truth = start.replace(hbm_eff=0.65, decode_mfu=0.22, step_overhead_s=4e-3, seq_overhead_s=3e-4)
    cal = Calibration(start, m)
    for tp in (1, 2, 4, 8):
        rc = RolloutCost(truth, m, tp)
        for b in (1, 8, 32, 128, 256):
            for per_req in (1024, 8192):
                cal.add_decode(tp, b, b * per_req, float(rc.decode_step_s(b, b * per_req)))
    res = cal.fit()
    hw = res.hardware
    assert hw.hbm_eff == pytest.approx(0.65, rel=1e-6)
    assert hw.decode_mfu == pytest.approx(0.22, rel=1e-6)
    assert hw.step_overhead_s == pytest.approx(4e-3, rel=1e-6)
    assert hw.seq_overhead_s == pytest.approx(3e-4, rel=1e-6)
    assert res.rel_error["decode"] < 1e-9


def test_efficiency_above_one_moves_into_the_peak():
    start = load_hardware("cpu")
    m = load_model("tiny-qwen2")
    truth = start.replace(hbm_bw=start.hbm_bw * 4, flops=start.flops * 4)  # 4x faster than the preset thinks
    cal = Calibration(start, m)
    rc = RolloutCost(truth, m, 1)
    for b, kv in ((1, 100), (4, 1000), (16, 4000)):
        cal.add_decode(1, b, kv, float(rc.decode_step_s(b, kv)))
    hw = cal.fit().hardware
    assert 0 < hw.hbm_eff <= 1 and 0 < hw.decode_mfu <= 1
    assert hw.hbm_bw * hw.hbm_eff == pytest.approx(truth.hbm_bw * truth.hbm_eff, rel=1e-6)


def test_ema():
    cal = Calibration(load_hardware("a800"), load_model("qwen3-4b"), ema_alpha=0.5)
    assert cal.scale("decode") == 1.0
    cal.observe("decode", 1.0, 2.0)
    assert cal.scale("decode") == 2.0
    cal.observe("decode", 1.0, 1.0)
    assert cal.scale("decode") == pytest.approx(1.5)
    hw = cal.apply_ema()
    assert hw.hbm_eff == pytest.approx(load_hardware("a800").hbm_eff / 1.5)
    with pytest.raises(ValueError):
        cal.observe("bogus", 1, 1)


def test_profiler_cli_writes_a_loadable_preset(tmp_path):
    out = tmp_path / "cpu_cal.yaml"
    r = subprocess.run([sys.executable, "-m", "areal_libra.cost.profile", "--quick", "--hidden", "64", "--layers", "1",
                        "--out", str(out), "--json"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["samples"] >= 5 and set(rep["rel_error"]) == {"decode", "prefill", "train"}
    assert "np." not in out.read_text()  # plain YAML numbers
    hw = load_hardware(str(out))
    assert hw.gpus_per_node == 2 and 0 < hw.hbm_eff <= 1 and hw.step_overhead_s >= 0
