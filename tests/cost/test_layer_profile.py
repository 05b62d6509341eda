"""The layer profile: the h200-fitted preset reproduces the measured H200 layer table, the fit is refused
when a table is corrupted, and the layer timing code runs on CPU at a small shape (no GPU here)."""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from areal_libra.cost.layer_bench import LayerShape, measure_layer
from areal_libra.cost.layer_fit import TableError, check_table, fit_table, layer_spec, load_table, predict_layer
from areal_libra.cost.presets import load_hardware, load_model
from areal_libra.cost.rollout import RolloutCost

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "tests" / "data" / "h200_measured.json"


def _profile(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "areal_libra.cost.profile", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def test_h200_fitted_preset_reproduces_the_measured_layer_table():
    table = json.loads(TABLE.read_text())
    hw = load_hardware("h200-fitted")
    spec = layer_spec(table["layer"])
    assert spec.params == pytest.approx(table["layer"]["params"], rel=1e-3)  # the same layer
    for r in table["decode_us"]:
        err = predict_layer(hw, spec, r, "decode") / (r["graph"] * 1e-6) - 1
        if r["batch"] >= 16:
            assert abs(err) <= 0.15, (r, err)
    for r in table["prefill_ms"]:
        err = predict_layer(hw, spec, r, "prefill") / (r["ms"] * 1e-3) - 1
        assert abs(err) <= 0.25, (r, err)


def test_h200_fitted_preset_is_what_the_fit_produces_now():
    """The committed preset is not stale: refitting the table gives the same per-layer figures."""
    fit = fit_table(load_table(TABLE), load_hardware("h200"), "h200-fitted")
    hw = load_hardware("h200-fitted")
    for f in ("hbm_eff", "decode_mfu", "prefill_mfu", "train_mfu", "decode_layer_overhead_s"):
        assert getattr(hw, f) == pytest.approx(getattr(fit.hardware, f), rel=1e-3), f
    assert hw.prefill_layer_overhead_s == pytest.approx(fit.hardware.prefill_layer_overhead_s, abs=1e-7)
    assert fit.check() is None
    # the per-layer overhead term carries weight: without it batch-16 decode misses by more than 15%
    spec = layer_spec(load_table(TABLE)["layer"])
    bare = fit.hardware.replace(decode_layer_overhead_s=0.0)
    r = {"batch": 16, "ctx": 1024}
    assert predict_layer(bare, spec, r, "decode") < 0.85 * 227.4e-6


def test_whole_model_is_layers_times_layer_plus_head_and_step():
    """Qwen3-14B decode, memory bound (batch 16): 40 x the fitted layer + the embedding/LM-head reads + the
    per-step overhead."""
    hw = load_hardware("h200-fitted")
    m = load_model("qwen3-14b")
    table = json.loads(TABLE.read_text())
    spec = layer_spec(table["layer"])
    b, ctx = 16, 1024
    whole = float(RolloutCost(hw, m, 1).decode_step_s(b, b * ctx))
    layer = predict_layer(hw, spec, {"batch": b, "ctx": ctx}, "decode")
    head = 2 * m.vocab * m.hidden * m.dtype_bytes / (hw.hbm_bw * hw.hbm_eff)  # the cost model reads both tables
    assert whole == pytest.approx(m.n_layers * layer + head + hw.step_overhead_s, rel=0.01)


def test_profiler_writes_the_fitted_preset_from_a_table(tmp_path):
    out = tmp_path / "h200.yaml"
    r = _profile("--table", str(TABLE), "--name", "h200-fitted", "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["max_rel_error"]["decode"] <= 0.15 and rep["max_rel_error"]["prefill"] <= 0.25
    hw = load_hardware(str(out))
    assert hw.decode_layer_overhead_s == pytest.approx(load_hardware("h200-fitted").decode_layer_overhead_s, rel=1e-3)


@pytest.mark.parametrize("corrupt", ["reversed_batches", "scale_prefill"])
def test_profiler_refuses_a_fit_with_a_large_error(tmp_path, corrupt):
    t = json.loads(TABLE.read_text())
    if corrupt == "reversed_batches":  # batch 1's timing under batch 256 and so on (rows mixed up)
        rows = [r for r in t["decode_us"] if r["ctx"] == 8192]
        for r, v in zip(rows, [r["graph"] for r in rows][::-1]):
            r["graph"] = v
    else:  # one prefill length 5x too slow
        t["prefill_ms"][1]["ms"] *= 5
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(t))
    out = tmp_path / "never.yaml"
    r = _profile("--table", str(bad), "--out", str(out))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: fit error too large"), r.stderr
    assert "Traceback" not in r.stderr and not out.exists()


def test_profiler_rejects_a_malformed_table_in_one_line(tmp_path):
    t = json.loads(TABLE.read_text())
    t2 = copy.deepcopy(t)
    t2["decode_us"][0]["graph"] = "fast"
    for body in ("{not json", json.dumps(t2), json.dumps({"layer": {}})):
        p = tmp_path / "t.json"
        p.write_text(body)
        r = _profile("--table", str(p))
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert r.stderr.startswith("error: ")
    with pytest.raises(TableError):
        check_table(t2)


def test_layer_timing_runs_on_cpu_at_a_small_shape():
    """No GPU here: the CUDA path (graphs, events) cannot run; the same layer code is timed eagerly."""
    shape = LayerShape(hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128)
    t = measure_layer(shape, "cpu", decode=[(1, 32), (4, 64)], prefill=[32, 64], train=[32], repeat=1, iters=1)
    check_table(t)  # the schema the fit reads
    assert t["layer"]["params"] == shape.params
    assert [(r["batch"], r["ctx"]) for r in t["decode_us"]] == [(1, 32), (4, 64)]
    assert all(r["eager"] > 0 for r in t["decode_us"]) and all(r["ms"] > 0 for r in t["prefill_ms"] + t["train_ms"])


def test_layer_shape_matches_the_model_preset():
    m = load_model("qwen3-14b")
    s = LayerShape.of_model(m)
    # the reference layer: 330.3M parameters
    assert s.params == pytest.approx(330.3e6, rel=1e-3)
    assert m.n_layers * s.params < m.params  # plus embedding and head
