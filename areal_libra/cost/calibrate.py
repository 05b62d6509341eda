"""Calibration: fit the cost models' efficiency factors to measured samples.

Offline (non-negative least squares on relative errors):
- decode: measured - comm = a_m * memory time [memory-bound samples] + a_c * compute time [compute-bound
  samples] + step overhead + per-request overhead * batch; the regimes are re-classified with the updated
  efficiencies until they settle; hbm_eff /= a_m, decode_mfu /= a_c;
- prefill: measured - comm = a * roofline time + per-call overhead; prefill_mfu /= a;
- train: measured = a * modelled step time; train_mfu /= a.
An efficiency that would exceed 1 moves into the peak figure instead (the preset's peak was too low),
keeping every other product unchanged.

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


def _nnls(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a handful of columns: the best of the unconstrained fits over every
    column subset whose coefficients are all >= 0 (exact for the few unknowns used here)."""
    n = X.shape[1]
    best_r, best = np.inf, np.zeros(n)
    for mask in range(1, 1 << n):
        cols = [j for j in range(n) if mask >> j & 1]
        coef, *_ = np.linalg.lstsq(X[:, cols], y, rcond=None)
        if np.any(coef < 0):
            continue
        r = float(np.sum((X[:, cols] @ coef - y) ** 2))
        if r < best_r - 1e-18:
            best_r, best = r, np.zeros(n)
            best[cols] = coef
    return best


def _scale_eff(hw: HardwareSpec, eff_field: str, factor: float) -> HardwareSpec:
    """Multiply an efficiency by `factor`; beyond 1 the excess goes into the matching peak figure and the
    sibling efficiencies that share that peak are divided by it, so their products stay put."""
    new = float(getattr(hw, eff_field) * factor)
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
    per_seq: bool = True  # fit a per-running-request decode overhead (seq_overhead_s)
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
        n_layers = self.model.n_layers
        if s.kind == "decode":
            total = float(rc.decode_step_s(s.batch, s.kv_tokens))
            # fixed: communication and the per-layer overhead (a preset figure, not fitted here)
            fixed = float(rc._comm_s(s.batch)) + n_layers * hw.decode_layer_overhead_s
            return total - fixed - hw.step_overhead_s - hw.seq_overhead_s * s.batch, fixed
        total = float(rc.prefill_s(s.tokens, s.context))
        fixed = float(rc._comm_s(s.tokens)) + n_layers * hw.prefill_layer_overhead_s
        return total - fixed - hw.prefill_overhead_s, fixed

    def predict(self, hw: HardwareSpec, s: Sample, train_kw: dict | None = None) -> float:
        tc = self._train_cost_factory(train_kw or {})
        scal, fixed = self._parts(hw, s, tc)
        ovh = {"decode": hw.step_overhead_s + hw.seq_overhead_s * s.batch,
               "prefill": hw.prefill_overhead_s}.get(s.kind, 0.0)
        return scal + fixed + ovh

    def _train_cost_factory(self, train_kw: dict) -> dict:
        def make(hw: HardwareSpec) -> TrainCost:
            n = max([s.par.gpus for s in self.samples if s.par is not None] + [1])
            cluster = ClusterSpec(hw, 1, max(n, 1))
            return TrainCost(cluster, self.model, **train_kw)

        return {"cost": make}

    # ---------------------------------------------------------------- fitting
    def fit(self, train_kw: dict | None = None) -> FitResult:
        """Fit every kind that has samples; returns the calibrated HardwareSpec and the errors after it."""
        hw = self.hw
        alpha: dict[str, float] = {}
        beta: dict[str, float] = {}
        dec = [s for s in self.samples if s.kind == "decode"]
        if dec:
            hw = self._fit_decode(hw, dec, alpha, beta)
        pre = [s for s in self.samples if s.kind == "prefill"]
        if pre:
            parts = [self._parts(hw, s, {}) for s in pre]
            y = np.array([s.measured_s for s in pre])
            X = np.stack([[p[0] for p in parts], np.ones(len(pre))], axis=1) / y[:, None]
            t = np.array([s.measured_s - p[1] for s, p in zip(pre, parts)]) / y
            a, b = (float(v) for v in _nnls(X, t))
            a = a if a > 0 else 1.0
            alpha["prefill"], beta["prefill"] = float(a), float(b)
            hw = _scale_eff(hw, "prefill_mfu", 1.0 / a).replace(prefill_overhead_s=float(b))
        tr = [s for s in self.samples if s.kind == "train"]
        if tr:
            tc = self._train_cost_factory(train_kw or {})
            x = np.array([self._parts(hw, s, tc)[0] for s in tr])
            y = np.array([s.measured_s for s in tr])
            a = float(np.sum(x / y) / np.sum((x / y) ** 2))  # relative least squares through the origin
            alpha["train"] = a
            hw = _scale_eff(hw, "train_mfu", 1.0 / a)
        err = {}
        for kind in KINDS:
            ss = [s for s in self.samples if s.kind == kind]
            if ss:
                err[kind] = float(np.mean([abs(self.predict(hw, s, train_kw) - s.measured_s) / s.measured_s
                                           for s in ss]))
        return FitResult(hw, alpha, beta, err)

    def _fit_decode(self, hw: HardwareSpec, dec: list[Sample], alpha: dict, beta: dict) -> HardwareSpec:
        y = np.array([s.measured_s for s in dec])
        batch = np.array([s.batch for s in dec], dtype=float)
        a_m_tot = a_c_tot = 1.0
        prev = None
        for _ in range(8):
            mem, comp, comm = [], [], []
            for s in dec:
                rc = RolloutCost(hw, self.model, s.tp)
                m_, c_ = rc.decode_parts(s.batch, s.kv_tokens)
                mem.append(float(m_))
                comp.append(float(c_))
                comm.append(float(rc._comm_s(s.batch)) + self.model.n_layers * hw.decode_layer_overhead_s)
            mem_a, comp_a = np.array(mem), np.array(comp)
            mb = mem_a >= comp_a
            if prev is not None and np.array_equal(mb, prev):
                break
            prev = mb
            # per_seq=False: no per-request term (a one-layer fit, whose overheads are per layer)
            X = np.stack([np.where(mb, mem_a, 0.0), np.where(mb, 0.0, comp_a), np.ones(len(dec)),
                          batch if self.per_seq else np.zeros(len(dec))], axis=1)
            coef = _nnls(X / y[:, None], (y - np.array(comm)) / y)
            a_m, a_c, b0, b1 = (float(v) for v in coef)
            # a regime without samples (or a degenerate zero) keeps the other regime's scale
            if a_m <= 0:
                a_m = a_c if a_c > 0 else 1.0
            if a_c <= 0:
                a_c = a_m
            hw = _scale_eff(_scale_eff(hw, "hbm_eff", 1.0 / a_m), "decode_mfu", 1.0 / a_c)
            hw = hw.replace(step_overhead_s=b0, seq_overhead_s=b1)
            a_m_tot *= a_m
            a_c_tot *= a_c
        alpha["decode_mem"], alpha["decode_compute"] = a_m_tot, a_c_tot
        beta["decode"], beta["decode_per_seq"] = hw.step_overhead_s, hw.seq_overhead_s
        return hw

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
