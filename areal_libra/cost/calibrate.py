"""Calibration: fit the cost models' efficiency factors to measured samples.

Offline (least squares): decode and prefill samples fit measured = alpha * modelled + beta, where
`modelled` is the roofline part of the current model (communication subtracted from the measurement) and
beta >= 0 is a fixed per-call overhead; the efficiency becomes eff / alpha. Training samples fit
measured = alpha * modelled through the origin and scale train_mfu. An efficiency that would exceed 1
moves into the peak figure instead (the preset's peak was too low), keeping every other product unchanged.

Online (EMA): `observe` keeps an exponential moving average of measured / predicted per kind; `scale(kind)`
multiplies predictions, `apply_ema` folds the ratios into a HardwareSpec.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from areal_libra.cost.presets import ClusterSpec, HardwareSpec, ModelSpec
from areal_libra.cost.rollout import RolloutCost
from areal_libra.cost.training import TrainCost, TrainParallel

KINDS = ("decode", "prefill", "train")


@dataclass(frozen=True)
class Sample:
    kind: str
    measured_s: float
    tp: int = 1
    batch: float = 1.0
    kv_tokens: float = 0.0
    tokens: float = 0.0
    context: float = 0.0
    par: TrainParallel | None = None
    seq_lengths: tuple[int, ...] = ()


@dataclass
class FitResult:
    hardware: HardwareSpec
    alpha: dict[str, float]
    beta: dict[str, float]
    rel_error: dict[str, float]  # mean |pred - meas| / meas after the fit


def _lsq(x: np.ndarray, y: np.ndarray, intercept: bool) -> tuple[float, float]:
    """y ~ a x + b with b >= 0 (b = 0 without intercept or when the free fit goes negative)."""
    if intercept and len(x) >= 2 and np.ptp(x) > 0:
        a, b = np.polyfit(x, y, 1)
        if b >= 0 and a > 0:
            return float(a), float(b)
    a = float(np.dot(x, y) / max(np.dot(x, x), 1e-300))
    return a, 0.0


def _scale_eff(hw: HardwareSpec, eff_field: str, factor: float) -> HardwareSpec:
    """Multiply an efficiency by `factor`; beyond 1 the excess goes into the matching peak figure and the
    sibling efficiencies that share that peak are divided by it, so their products stay put."""
    new = getattr(hw, eff_field) * factor
    if new <= 1.0:
        return hw.replace(**{eff_field: max(new, 1e-6)})
    over = new
    if eff_field == "hbm_eff":
        return hw.replace(hbm_eff=1.0, hbm_bw=hw.hbm_bw * over)
    siblings = {"decode_mfu", "prefill_mfu", "train_mfu"} - {eff_field}
    kw = {k: getattr(hw, k) / over for k in siblings}
    return hw.replace(flops=hw.flops * over, **{eff_field: 1.0}, **kw)


@dataclass
class Calibration:
    hw: HardwareSpec
    model: ModelSpec
    samples: list[Sample] = field(default_factory=list)
    ema_alpha: float = 0.2
    _ema: dict[str, float] = field(default_factory=dict)

    # ---------------------------------------------------------------- samples
    def add_decode(self, tp: int, batch: float, kv_tokens: float, seconds: float) -> None:
        self.samples.append(Sample("decode", seconds, tp=tp, batch=batch, kv_tokens=kv_tokens))

    def add_prefill(self, tp: int, tokens: float, seconds: float, context: float = 0.0) -> None:
        self.samples.append(Sample("prefill", seconds, tp=tp, tokens=tokens, context=context))

    def add_train(self, par: TrainParallel, seq_lengths: Sequence[int], seconds: float) -> None:
        self.samples.append(Sample("train", seconds, par=par, seq_lengths=tuple(seq_lengths)))

    # ---------------------------------------------------------------- model parts
    def _parts(self, hw: HardwareSpec, s: Sample, train_cost: dict) -> tuple[float, float]:
        """(scalable roofline part, fixed part) of the model's prediction for one sample."""
        if s.kind == "train":
            assert s.par is not None
            return train_cost["cost"](hw).step_time_s(s.par, list(s.seq_lengths)), 0.0
        rc = RolloutCost(hw, self.model, s.tp)
        if s.kind == "decode":
            total = float(rc.decode_step_s(s.batch, s.kv_tokens))
            comm = float(rc._comm_s(s.batch))
            return total - comm - hw.step_overhead_s, comm
        total = float(rc.prefill_s(s.tokens, s.context))
        comm = float(rc._comm_s(s.tokens))
        return total - comm - hw.prefill_overhead_s, comm

    def predict(self, hw: HardwareSpec, s: Sample, train_kw: dict | None = None) -> float:
        tc = self._train_cost_factory(train_kw or {})
        scal, fixed = self._parts(hw, s, tc)
        ovh = {"decode": hw.step_overhead_s, "prefill": hw.prefill_overhead_s}.get(s.kind, 0.0)
        return scal + fixed + ovh

    def _train_cost_factory(self, train_kw: dict) -> dict:
        def make(hw: HardwareSpec) -> TrainCost:
            n = max([s.par.gpus for s in self.samples if s.par is not None] + [1])
            cluster = ClusterSpec(hw, 1, max(n, 1))
            return TrainCost(cluster, self.model, **train_kw)

        return {"cost": make}

    # ---------------------------------------------------------------- fitting
    def fit(self, train_kw: dict | None = None) -> FitResult:
        """Least-squares fit of every kind that has samples; returns the calibrated HardwareSpec."""
        hw = self.hw
        tc = self._train_cost_factory(train_kw or {})
        alpha, beta = {}, {}
        for kind, eff_fields, ovh_field in (("decode", ("hbm_eff", "decode_mfu"), "step_overhead_s"),
                                            ("prefill", ("prefill_mfu",), "prefill_overhead_s"),
                                            ("train", ("train_mfu",), None)):
            ss = [s for s in self.samples if s.kind == kind]
            if not ss:
                continue
            parts = [self._parts(hw, s, tc) for s in ss]
            x = np.array([p[0] for p in parts])
            y = np.array([s.measured_s - p[1] for s, p in zip(ss, parts)])
            a, b = _lsq(x, y, intercept=ovh_field is not None)
            alpha[kind], beta[kind] = a, b
            for f in eff_fields:
                hw = _scale_eff(hw, f, 1.0 / a)
            if ovh_field:
                hw = hw.replace(**{ovh_field: b})
        err = {}
        for kind in KINDS:
            ss = [s for s in self.samples if s.kind == kind]
            if ss:
                err[kind] = float(np.mean([abs(self.predict(hw, s, train_kw) - s.measured_s) / s.measured_s
                                           for s in ss]))
        return FitResult(hw, alpha, beta, err)

    # ---------------------------------------------------------------- online
    def observe(self, kind: str, predicted_s: float, measured_s: float) -> float:
        """Fold one measured/predicted ratio into the EMA for `kind`; returns the current ratio."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if predicted_s <= 0 or measured_s <= 0:
            return self.scale(kind)
        r = measured_s / predicted_s
        prev = self._ema.get(kind)
        self._ema[kind] = r if prev is None else (1 - self.ema_alpha) * prev + self.ema_alpha * r
        return self._ema[kind]

    def scale(self, kind: str) -> float:
        return self._ema.get(kind, 1.0)

    def apply_ema(self, hw: HardwareSpec | None = None) -> HardwareSpec:
        """A HardwareSpec whose efficiencies absorb the EMA ratios (slower than predicted = lower eff)."""
        hw = hw or self.hw
        if "decode" in self._ema:
            for f in ("hbm_eff", "decode_mfu"):
                hw = _scale_eff(hw, f, 1.0 / self._ema["decode"])
        if "prefill" in self._ema:
            hw = _scale_eff(hw, "prefill_mfu", 1.0 / self._ema["prefill"])
        if "train" in self._ema:
            hw = _scale_eff(hw, "train_mfu", 1.0 / self._ema["train"])
        return hw
