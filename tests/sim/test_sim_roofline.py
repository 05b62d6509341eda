"""The roofline bound: what it counts, and that no simulated system exceeds it."""

import pytest

from areal_libra.sim.cluster import Layout, RunConfig, Simulation, TrainLayout
from areal_libra.sim.hardware import truth_for
from areal_libra.sim.report import add_roofline
from areal_libra.sim.roofline import decode_token_contexts, roofline
from areal_libra.sim.workloads import WorkloadConfig, make_workload
from areal_libra.trace import Segment, ToolReturn, Trajectory

TRAJ = Trajectory("t", "p", 0, 100, (Segment(5, ToolReturn("bash", 7, "success", 3.0)), Segment(4, None)))


def test_decode_contexts_sum_every_token_context():
    # Token by token: 5 tokens at contexts 100..104, then the payload (7), then 4 tokens at 112..115.
    want = sum(range(100, 105)) + sum(range(112, 116))
    assert decode_token_contexts(TRAJ) == (9, want)


def test_roofline_adds_decode_prefill_and_training_at_the_truth_limits():
    truth = truth_for("h200", "qwen3-14b")
    r = roofline(truth, [TRAJ] * 10, n_gpus=8, max_running=4)
    a, b = truth.decode_gpu_coeffs(1, 4)
    assert r["roofline_batch"] == 4
    assert r["decode_gpu_s"] == pytest.approx(10 * (9 * a / 4 + b * decode_token_contexts(TRAJ)[1]))
    assert r["prefill_gpu_s"] == pytest.approx(10 * (truth.prefill_s(1, 100) + truth.prefill_s(1, 7, 105)))
    total = r["decode_gpu_s"] + r["prefill_gpu_s"] + r["train_gpu_s"]
    assert r["roofline_tokens_per_s"] == pytest.approx(90 * 8 / total)
    # Twice the GPUs, twice the bound (perfect balance).
    assert roofline(truth, [TRAJ] * 10, 16, 4)["roofline_tokens_per_s"] == pytest.approx(2 * r["roofline_tokens_per_s"])


@pytest.mark.parametrize("workload", ["r2e_gym", "dapo_math"])
def test_a_simulated_run_stays_below_its_roofline(workload):
    wl = make_workload(workload, WorkloadConfig(group_size=4, batch_prompts=4, drift=0.5, horizon=20))
    sim = Simulation(truth_for("a800", "qwen3-14b"), wl, 16, Layout(TrainLayout(8, 1, 1), [(2, 0)] * 4),
                     RunConfig(max_staleness=2), seed=0)
    res = sim.run(6)
    add_roofline(res, sim)
    assert len(sim.trained) == 6 * 4 * 4
    assert 0.0 < res["roofline_frac"] < 1.0
