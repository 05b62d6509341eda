"""The simulator's hardware truth agrees with the public inputs it was anchored to."""

import pytest

from areal_libra.sim.hardware import VLLM_2023, truth_for
from evaluation.sim_bench import decode_benchmark

# Public vLLM decode benchmark, Mistral-7B on A100, 320 prompts x 2,000 tokens, tokens/s.
TP_TABLE = {1: 1591, 2: 1862, 4: 2228, 8: 2381}


@pytest.mark.parametrize("tp", sorted(TP_TABLE))
def test_single_server_decode_rate_matches_public_tp_table(tp):
    truth = truth_for("a100", "mistral-7b", VLLM_2023)  # that benchmark's engine: vLLM's host cost per sequence
    run = decode_benchmark(truth, tp, n_prompts=320, output_tokens=2000)
    assert run.gen_tokens == 320 * 2000
    assert run.decode_tokens_per_s == pytest.approx(TP_TABLE[tp], rel=0.25)


def test_per_gpu_throughput_falls_with_tp_and_kv_capacity_grows():
    truth = truth_for("a100", "mistral-7b", VLLM_2023)
    per_gpu = [decode_benchmark(truth, tp, n_prompts=64, output_tokens=256).decode_tokens_per_s / tp
               for tp in (1, 2, 4, 8)]
    assert all(a > b for a, b in zip(per_gpu, per_gpu[1:]))
    caps = [truth.kv_capacity_tokens(tp) for tp in (1, 2, 4, 8)]
    assert all(b > 2 * a * 0.99 for a, b in zip(caps, caps[1:]))  # weights are split, KV pool grows


def test_qwen3_14b_on_a800_matches_the_reference_facts():
    truth = truth_for("a800", "qwen3-14b")
    assert truth.model.kv_bytes_per_token == 40 * 8 * 128 * 2 * 2  # 160 KB per token
    # Weight-read floor: ~14 ms per decode step at TP1 and ~3.5 ms at TP4 (plus host and all-reduce time).
    one = truth.decode_iteration_s(1, 1, 0)
    four = truth.decode_iteration_s(4, 1, 0)
    assert 0.014 <= one <= 0.030
    assert 0.0035 <= four < one / 1.8


def test_training_step_grows_with_tokens_and_shrinks_with_gpus():
    truth = truth_for("a800", "qwen3-14b")
    short = truth.train_step_s([2000] * 128, 8, 1, 2)
    long = truth.train_step_s([8000] * 128, 8, 1, 2)
    wide = truth.train_step_s([8000] * 128, 8, 1, 4)
    assert long > 3.5 * (short - truth.c.optimizer_s)
    assert wide < long * 0.6
