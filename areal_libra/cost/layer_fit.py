"""Fit per-layer hardware figures to one layer's timings (cost.layer_bench or a measured table).

The layer is modelled as a one-layer ModelSpec (no vocabulary) with every whole-model overhead at zero, and
cost.calibrate fits, on it: HBM and decode-compute efficiencies plus a per-layer decode overhead (what a
layer costs beyond its roofline share: kernel launches and tails), the prefill MFU plus a per-layer
prefill overhead, and the training MFU. The preset keeps the start preset's peaks and whole-step terms
(host scheduling, sampling: not in a layer measurement) and takes the fitted per-layer figures, so a whole
model costs n_layers x the layer + its embedding/LM head + the per-step terms (cost.rollout).

`check` holds the fit to its tolerances: decode within 15% at batch >= 16 (35% below), prefill and train
within 25%; a table outside them is not turned into a preset.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from areal_libra.cost.calibrate import Calibration
from areal_libra.cost.presets import ClusterSpec, HardwareSpec, ModelSpec
from areal_libra.cost.rollout import RolloutCost
from areal_libra.cost.training import TrainCost, TrainParallel

TOL_DECODE = 0.15  # batch >= 16
TOL_DECODE_SMALL = 0.35  # batch < 16: launch-bound, long-context attention is not a roofline
TOL_PREFILL = 0.25
TOL_TRAIN = 0.25
TRAIN_KW = {"recompute": False, "logprob_passes": 0}  # the table's train step: forward + backward only


class TableError(ValueError):
    """A layer table that cannot be used; the message is one line."""


@dataclass
class LayerFit:
    hardware: HardwareSpec  # the preset: per-layer figures fitted, whole-step terms from the start preset
    rows: list[dict] = field(default_factory=list)  # kind, shape, measured_s, predicted_s, rel_error

    def worst(self) -> dict[str, float]:
        """Largest |relative error| per group: decode (batch >= 16), decode_small, prefill, train."""
        out: dict[str, float] = {}
        for r in self.rows:
            g = r["kind"] if r["kind"] != "decode" or r["batch"] >= 16 else "decode_small"
            out[g] = max(out.get(g, 0.0), abs(r["rel_error"]))
        return out

    def check(self) -> str | None:
        """None if the fit is within tolerance, else one line naming the worst miss."""
        tol = {"decode": TOL_DECODE, "decode_small": TOL_DECODE_SMALL, "prefill": TOL_PREFILL, "train": TOL_TRAIN}
        for g, err in self.worst().items():
            if err > tol[g]:
                r = max((r for r in self.rows if (r["kind"] if r["kind"] != "decode" or r["batch"] >= 16
                                                  else "decode_small") == g), key=lambda r: abs(r["rel_error"]))
                what = ", ".join(f"{k}={r[k]}" for k in ("batch", "ctx", "tokens") if k in r)
                return (f"fit error too large: {g} {what} predicted {r['predicted_s'] * 1e6:.1f} us, measured "
                        f"{r['measured_s'] * 1e6:.1f} us ({r['rel_error']:+.0%}, tolerance {tol[g]:.0%})")
        return None


def layer_spec(layer: dict, dtype_bytes: int = 2) -> ModelSpec:
    """A one-layer model of the table's layer shape (vocabulary 1: no embedding or head to speak of)."""
    return ModelSpec(name="layer", n_layers=1, hidden=int(layer["hidden"]), n_heads=int(layer["heads"]),
                     n_kv_heads=int(layer["kv_heads"]), head_dim=int(layer["head_dim"]), ffn=int(layer["ffn"]),
                     vocab=1, tie_embeddings=True, dtype_bytes=dtype_bytes)


def load_table(path: str | Path) -> dict:
    """Read and check a layer table (the schema of tests/data/h200_measured.json); TableError on any problem."""
    p = Path(path)
    try:
        t = json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise TableError(f"{p}: cannot read ({e.strerror})") from None
    except ValueError as e:
        raise TableError(f"{p}: not JSON ({e})") from None
    check_table(t, str(p))
    return t


def _pos(v: object, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise TableError(f"{where} must be a positive number, got {v!r}")
    return float(v)


def check_table(t: object, where: str = "table") -> None:
    if not isinstance(t, dict) or not isinstance(t.get("layer"), dict):
        raise TableError(f"{where}: expected an object with a 'layer' shape")
    for k in ("hidden", "heads", "kv_heads", "head_dim", "ffn"):
        v = _pos(t["layer"].get(k), f"{where}: layer.{k}")
        if v != int(v):
            raise TableError(f"{where}: layer.{k} must be an integer, got {v}")
    if int(t["layer"]["heads"]) % int(t["layer"]["kv_heads"]):
        raise TableError(f"{where}: layer.heads must be a multiple of layer.kv_heads")
    n = 0
    for key, fields in (("decode_us", ("batch", "ctx")), ("prefill_ms", ("tokens", "ms")),
                        ("train_ms", ("tokens", "ms"))):
        rows = t.get(key, [])
        if not isinstance(rows, list):
            raise TableError(f"{where}: {key} must be a list")
        for i, r in enumerate(rows):
            if not isinstance(r, dict):
                raise TableError(f"{where}: {key}[{i}] must be an object")
            for f in fields:
                _pos(r.get(f), f"{where}: {key}[{i}].{f}")
            if key == "decode_us":
                _pos(r.get("graph", r.get("eager")), f"{where}: {key}[{i}].graph")
            n += 1
    if not t.get("decode_us") or not t.get("prefill_ms"):
        raise TableError(f"{where}: needs decode_us and prefill_ms rows")
    if n < 4:
        raise TableError(f"{where}: {n} rows are too few to fit")


def predict_layer(hw: HardwareSpec, spec: ModelSpec, row: dict, kind: str) -> float:
    """The preset's time for one layer (spec: layer_spec) in one table row; whole-step terms left out."""
    hw = hw.replace(step_overhead_s=0.0, seq_overhead_s=0.0, prefill_overhead_s=0.0)
    rc = RolloutCost(hw, spec, 1)
    if kind == "decode":
        return float(rc.decode_step_s(row["batch"], row["batch"] * row["ctx"]))
    if kind == "prefill":
        return float(rc.prefill_s(row["tokens"]))
    return TrainCost(ClusterSpec(hw, 1, 1), spec, **TRAIN_KW).step_time_s(TrainParallel(1, 1, 1, 1, 1),
                                                                         [int(row["tokens"])])


def fit_table(table: dict, start: HardwareSpec, name: str | None = None) -> LayerFit:
    """Fit the start preset's efficiencies and the per-layer overheads to a layer table."""
    check_table(table)
    spec = layer_spec(table["layer"], dtype_bytes=4 if table.get("dtype") == "float32" else 2)
    zero = start.replace(step_overhead_s=0.0, seq_overhead_s=0.0, prefill_overhead_s=0.0,
                         decode_layer_overhead_s=0.0, prefill_layer_overhead_s=0.0)
    cal = Calibration(zero, spec, per_seq=False)
    for r in table["decode_us"]:
        cal.add_decode(1, r["batch"], r["batch"] * r["ctx"], r.get("graph", r.get("eager")) * 1e-6)
    for r in table["prefill_ms"]:
        cal.add_prefill(1, r["tokens"], r["ms"] * 1e-3)
    for r in table.get("train_ms", []):
        cal.add_train(TrainParallel(1, 1, 1, 1, 1), [int(r["tokens"])], r["ms"] * 1e-3)
    fitted = cal.fit(TRAIN_KW).hardware
    # One layer: the fitted per-step/per-call constants are per-layer figures.
    hw = fitted.replace(name=name or f"{start.name}-fitted", step_overhead_s=start.step_overhead_s,
                        seq_overhead_s=start.seq_overhead_s, prefill_overhead_s=start.prefill_overhead_s,
                        decode_layer_overhead_s=fitted.step_overhead_s,
                        prefill_layer_overhead_s=fitted.prefill_overhead_s)
    out = LayerFit(hw)
    for kind, key, unit in (("decode", "decode_us", 1e-6), ("prefill", "prefill_ms", 1e-3),
                            ("train", "train_ms", 1e-3)):
        for r in table.get(key, []):
            meas = (r.get("graph", r.get("eager")) if kind == "decode" else r["ms"]) * unit
            pred = predict_layer(hw, spec, r, kind)
            row = {"kind": kind, **{k: r[k] for k in ("batch", "ctx", "tokens") if k in r},
                   "measured_s": meas, "predicted_s": pred, "rel_error": pred / meas - 1.0}
            out.rows.append(row)
    return out


def preset_yaml(hw: HardwareSpec, header: str) -> str:
    """The preset as a YAML mapping body (plain numbers), preceded by `header` comment lines."""
    from dataclasses import asdict

    lines = [f"# {h}" for h in header.splitlines()]
    for k, v in asdict(hw).items():
        if k == "name":
            continue
        lines.append(f"{k}: {v if isinstance(v, (int, str)) else float(v)!r}")
    return "\n".join(lines) + "\n"
