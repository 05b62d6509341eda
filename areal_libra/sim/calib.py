"""The profiling pass a user runs before training (what `areal_libra.cost.calibrate` is fed on a real
cluster): time decode iterations, prefills and a training step on the hardware truth, with its noise,
and fit the Cost Evaluator's efficiency factors to them. The planner then plans on the calibrated
spec; it never reads the truth model itself."""

from __future__ import annotations

import math
import random

from areal_libra.sim.hardware import HardwareTruth

# Also time training steps in the profiling pass and fit the training cost model's efficiency to them.
CALIBRATE_TRAIN = False


def profile_samples(truth: HardwareTruth, seed: int = 0, tps=(1, 2, 4, 8), train: bool = False,
                    train_lens: tuple[int, ...] | None = None) -> list[tuple]:
    """Measured samples: ('decode', tp, batch, kv_tokens, s), ('prefill', tp, tokens, s) and, with `train` or
    `train_lens`, ('train', (tp, pp, dp), seq_lens, s). `train_lens`: time the training step on the run's own
    batch (one global batch of the first profile's lengths, micro-batches of one sequence as the planner
    configures the trainer) instead of the fixed 64-sequence batch."""
    rng = random.Random(seed)
    out: list[tuple] = []
    sig = truth.c.noise_sigma
    for tp in tps:
        cap = truth.kv_capacity_tokens(tp)
        if cap <= 0:
            continue
        for batch in (1, 8, 32, 64, 128, 256):
            for per_req in (1024, 4096, 16384):
                kv = batch * per_req
                if kv > cap:
                    continue
                t = truth.decode_iteration_s(tp, batch, kv) * math.exp(rng.gauss(0, sig))
                out.append(("decode", tp, batch, kv, t))
        for n in (512, 2048, 8192):
            out.append(("prefill", tp, n, truth.prefill_s(tp, n) * math.exp(rng.gauss(0, sig))))
    if train or train_lens:
        # One timed training step per single-node layout that fits (what a user measures with the trainer
        # before a run), on the run's batch when given, else a fixed profiling batch of mixed lengths.
        lens = tuple(train_lens) if train_lens else tuple([1024, 2048, 4096, 8192] * 16)
        gpn = truth.gpu.gpus_per_node
        for tp in (1, 2, 4, 8):
            for pp in (1, 2, 4):
                dp = gpn // (tp * pp)
                if dp < 1 or tp * pp * dp != gpn or not truth.train_memory_ok(tp, pp, dp):
                    continue
                mb = -(-len(lens) // dp) if train_lens else None
                t = truth.train_step_s(lens, tp, pp, dp, mb) * math.exp(rng.gauss(0, sig))
                out.append(("train", (tp, pp, dp), lens, t))
    return out


def calibrated_hardware(truth: HardwareTruth, hw, model, seed: int = 0,
                        train_lens: tuple[int, ...] | None = None):
    """Fit `hw` (a cost.presets.HardwareSpec) to the profiling samples with the Cost Evaluator's own
    calibration; returns (calibrated HardwareSpec, relative errors after the fit). `train_lens`: also time
    training steps on this batch (profile_samples) and fit the training efficiency to them."""
    from areal_libra.cost.calibrate import Calibration
    from areal_libra.cost.training import TrainParallel

    cal = Calibration(hw, model)
    for s in profile_samples(truth, seed, train=CALIBRATE_TRAIN, train_lens=train_lens):
        if s[0] == "decode":
            cal.add_decode(s[1], s[2], s[3], s[4])
        elif s[0] == "train":
            tp, pp, dp = s[1]
            cal.add_train(TrainParallel(tp, pp, dp), s[2], s[3])
        else:
            cal.add_prefill(s[1], s[2], s[3])
    fit = cal.fit()
    return fit.hardware, fit.rel_error
