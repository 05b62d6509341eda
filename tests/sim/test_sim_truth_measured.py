"""The simulator's hardware truth against per-layer timings measured on one H200 (tests/data/h200_measured.json):
decode within 15% at batch >= 16, prefill within 25%, and a training step no faster than the measured layer."""

import json
from pathlib import Path

import pytest

from areal_libra.sim.hardware import GPUS, MODELS, SGLANG, HardwareTruth, ModelShape, truth_for

DATA = json.loads((Path(__file__).resolve().parents[1] / "data" / "h200_measured.json").read_text())
L = DATA["layer"]


def layer_truth() -> HardwareTruth:
    """One Qwen3-14B-shaped layer (no embedding, no LM head) on the simulator's H200 spec sheet."""
    shape = ModelShape("qwen3-14b-layer", L["params"], L["params"], 1, L["hidden"], L["heads"], L["kv_heads"],
                       L["head_dim"])
    return HardwareTruth(GPUS[DATA["gpu"]], shape, SGLANG)


def test_layer_shape_matches_the_measured_layer():
    m = MODELS["qwen3-14b"]
    per_layer = (m.params - m.embed_params - 151936 * 5120) / m.layers  # minus the LM head
    assert per_layer == pytest.approx(L["params"], rel=0.01)
    assert layer_truth().model.kv_bytes_per_token == 8 * 128 * 2 * 2


@pytest.mark.parametrize("row", [r for r in DATA["decode_us"] if r["batch"] >= 16], ids=lambda r: f"{r['batch']}x{r['ctx']}")
def test_decode_gpu_time_within_15_percent(row):
    a, b = layer_truth().decode_gpu_coeffs(1, row["batch"])
    got_us = (a + b * row["batch"] * row["ctx"]) * 1e6
    assert got_us == pytest.approx(row["graph"], rel=0.15)


@pytest.mark.parametrize("row", DATA["prefill_ms"], ids=lambda r: str(r["tokens"]))
def test_prefill_within_25_percent(row):
    assert layer_truth().prefill_s(1, row["tokens"]) * 1e3 == pytest.approx(row["ms"], rel=0.25)


def test_training_is_not_faster_than_the_measured_layer():
    # The truth's step adds a recompute forward (8 vs 6 FLOPs per parameter and token) and runs at a whole
    # job's MFU; per forward+backward it must be no faster than the bare measured layer, nor 1.6x slower.
    t = layer_truth()
    row = DATA["train_ms"][0]
    step = t.train_step_s([row["tokens"]], 1, 1, 1) - t.c.optimizer_s
    fwd_bwd_ms = step * 6.0 / 8.0 * 1e3
    assert 1.0 <= fwd_bwd_ms / row["ms"] <= 1.6


def test_whole_model_decode_step_is_layers_plus_lm_head():
    # The measurement's own recipe for a whole Qwen3-14B at TP1: x40 layers + one read of the LM head.
    whole = truth_for("h200", "qwen3-14b")
    lay = layer_truth()
    for row in DATA["decode_us"]:
        if row["batch"] < 16:
            continue
        kv = row["batch"] * row["ctx"]
        want = 40 * lay.decode_iteration_s(1, row["batch"], kv) - 39 * SGLANG.host_overhead_s
        want += 151936 * 5120 * 2.0 / (whole.gpu.hbm_bw * whole.c.weight_read_eff)
        got = whole.decode_iteration_s(1, row["batch"], kv)
        assert got == pytest.approx(want, rel=0.05)
