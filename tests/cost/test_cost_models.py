"""Cost models against values computed by hand for a documented case, and the fluid group estimate
against the exact event-driven makespan.

Documented case: Qwen3-14B on A800 (preset efficiencies hbm_eff 0.8, decode_mfu 0.35, step overhead 1.5 ms,
workspace 8 GB, NVLink 400 GB/s x comm_eff 0.8, 10 us per collective).
  weights  = 14,768,291,840 params x 2 B = 29,536,583,680 B;  KV = 163,840 B/token
  KV capacity TP1 = (80e9 - 8e9 - 29,536,583,680) / 163,840 = 259,176 tokens
  KV capacity TP4 = (4 x 72e9 - 29,536,583,680) / 163,840 = 1,577,535 tokens (2 KV heads per GPU, no repeat)
  decode TP1, batch 1, no KV: 29,536,583,680 / (2.039e12 x 0.8) = 18.1076 ms (> compute 0.27 ms) + 1.5 ms
  decode TP4, batch 1, no KV: weights/4 / 1.6312e12 = 4.5269 ms, + 80 all-reduces of 10,240 B each:
     80 x (10 us + 2 x 3/4 x 10,240 / 320e9) = 0.80384 ms, + 1.5 ms
"""

import random

import pytest

from areal_libra.cost.presets import load_cluster, load_hardware, load_model
from areal_libra.cost.rollout import RolloutCost
from areal_libra.cost.training import TrainCost, TrainParallel

A800 = load_hardware("a800")
Q14 = load_model("qwen3-14b")


def test_rollout_hand_values():
    w = 29_536_583_680
    assert Q14.weight_bytes == w
    assert RolloutCost(A800, Q14, 1).kv_capacity_tokens() == (80e9 - 8e9 - w) // 163_840
    assert RolloutCost(A800, Q14, 1).kv_capacity_tokens() == 259_176
    assert RolloutCost(A800, Q14, 4).kv_capacity_tokens() == (4 * 72e9 - w) // 163_840
    tp1 = RolloutCost(A800, Q14, 1).decode_step_s(1, 0)
    assert tp1 == pytest.approx(w / (2.039e12 * 0.8) + 1.5e-3, rel=1e-9)
    assert tp1 == pytest.approx(19.6076e-3, rel=1e-4)
    tp4 = RolloutCost(A800, Q14, 4).decode_step_s(1, 0)
    ar = 80 * (10e-6 + 2 * 3 / 4 * 10_240 / (400e9 * 0.8))
    assert tp4 == pytest.approx(w / 4 / (2.039e12 * 0.8) + ar + 1.5e-3, rel=1e-9)
    # KV read: 100k resident tokens at TP1 add 100k x 163,840 B / 1.6312 TB/s = 10.04 ms
    assert RolloutCost(A800, Q14, 1).decode_step_s(1, 100_000) - tp1 == pytest.approx(
        100_000 * 163_840 / (2.039e12 * 0.8), rel=1e-9)


def test_kv_heads_replicate_beyond_kv_head_count():
    # Qwen2.5-7B has 4 KV heads: at TP8 each head lives on 2 GPUs, so capacity is not 8x the per-GPU share.
    m = load_model("qwen2.5-7b")
    rc = RolloutCost(A800, m, 8)
    free = 8 * (80e9 - 8e9) - m.weight_bytes
    assert rc.kv_capacity_tokens() == int(free // (m.kv_bytes_per_token * 2))


def test_decode_grows_with_batch_and_kv_and_moe_reads_fewer_experts_at_small_batch():
    rc = RolloutCost(A800, Q14, 2)
    assert rc.decode_step_s(64, 1e5) > rc.decode_step_s(64, 1e4) > rc.decode_step_s(1, 1e4)
    moe = RolloutCost(A800, load_model("qwen3-30b-a3b"), 1)
    assert moe._weight_read_bytes(1) < moe._weight_read_bytes(64) <= load_model("qwen3-30b-a3b").weight_bytes + 1


def test_makespan_hand_case():
    """Two requests that fit together: one prefill burst, then 10 steps at batch 2 and 10 at batch 1."""
    rc = RolloutCost(A800, Q14, 1)
    reqs = [(100, 10), (100, 20)]
    t = rc.makespan_s(reqs)
    ovh = A800.prefill_overhead_s
    prefill = 2 * (float(rc.prefill_s(100)) - ovh) + ovh
    decode = sum(float(rc.decode_step_s(2, 200 + 2 * j)) for j in range(10))
    decode += sum(float(rc.decode_step_s(1, 110 + j)) for j in range(10))
    assert t == pytest.approx(prefill + decode, rel=1e-9)


def test_makespan_honours_kv_capacity():
    """Requests that cannot be resident together run one after another."""
    hw = A800.replace(hbm_bytes=8e9 + 29_536_583_680 + 163_840 * 1500)  # room for 1,500 tokens
    rc = RolloutCost(hw, Q14, 1)
    assert rc.kv_capacity_tokens() == 1500
    one = rc.makespan_s([(500, 500)])
    both = rc.makespan_s([(500, 500), (500, 500)])
    assert both == pytest.approx(2 * one, rel=1e-9)  # serialised: 2 x 1,000 > 1,500
    with pytest.raises(ValueError, match="exceeds"):
        rc.makespan_s([(1000, 600)])


def test_group_estimate_tracks_event_simulation():
    rng = random.Random(3)
    for tp in (1, 2, 4):
        rc = RolloutCost(A800, Q14, tp, max_running=32)
        for _ in range(5):
            n = rng.randint(5, 60)
            reqs = sorted(((rng.randint(50, 800), rng.randint(50, 4000)) for _ in range(n)), key=lambda r: -sum(r))
            exact = rc.makespan_s(reqs)
            mp = sum(p for p, _ in reqs) / n
            mo = sum(o for _, o in reqs) / n
            est = float(rc.group_makespan_s(n, mp, mo, max(o for _, o in reqs), max(p + o for p, o in reqs)))
            assert 0.6 < est / exact < 1.5, (tp, n, est, exact)


def test_training_hand_values():
    """TP2 PP2 DP1, 4 sequences of 1,024 tokens, micro-batch 1 on A800 (train_mfu 0.45):
    fwd FLOPs per micro-batch = 2 x 14.768e9 x 1024 + 2 x 40 x 5120 x 1024^2;  T_f = that / (4 GPUs x
    312e12 x 0.45) + 20 layers x 2 all-reduces of 1024 x 5120 x 2 B + one PP send; T_b = 3 x compute (with
    recompute) + 2 x the all-reduces + send; 1F1B = (4 + 1) x (T_f + T_b); plus one log-prob pass."""
    c = load_cluster("a800x8")
    tc = TrainCost(c, Q14)
    par = TrainParallel(tp=2, pp=2, dp=1, micro_batch=1)
    b = tc.breakdown(par, [1024] * 4)
    fwd = 2 * Q14.params * 1024 + 2 * 40 * 5120 * 1024**2
    comp = fwd / (4 * 312e12 * 0.45)
    ar = 20 * 2 * (10e-6 + 2 * 1 / 2 * 1024 * 5120 * 2 / (400e9 * 0.8))
    send = 10e-6 + 1024 * 5120 * 2 / (400e9 * 0.8)
    t_f, t_b = comp + ar + send, 3 * comp + 2 * ar + send
    assert b["t_f"] == pytest.approx(t_f, rel=1e-9)
    assert b["t_b"] == pytest.approx(t_b, rel=1e-9)
    assert b["pipeline"] == pytest.approx(5 * (t_f + t_b), rel=1e-9)
    assert b["bubble"] == pytest.approx(1 / 5)
    assert b["logprob"] == pytest.approx(5 * t_f, rel=1e-9)
    assert b["dp_allreduce"] == 0.0
    assert tc.step_time_s(par, [1024] * 4) == pytest.approx(b["pipeline"] + b["logprob"] + b["optimizer"])


def test_training_memory_and_oom():
    """Qwen3-14B on one A800 does not fit (16 B/param of weights+grads+Adam alone = 236 GB); TP8 does."""
    c = load_cluster("a800x8")
    tc = TrainCost(c, Q14)
    m1 = tc.memory_breakdown(TrainParallel(1, 1, 1), [4096] * 8)
    assert m1["weights"] + m1["grads"] + m1["optimizer"] == pytest.approx(Q14.params * 18)
    assert not tc.fits(TrainParallel(1, 1, 1), [4096] * 8)
    assert tc.fits(TrainParallel(8, 1, 1), [4096] * 8)
    # the distributed optimizer shards Adam state over DP
    m8 = tc.memory_breakdown(TrainParallel(1, 1, 8), [4096] * 8)
    assert m8["optimizer"] == pytest.approx(m1["optimizer"] / 8)
    # longer sequences need more activation memory
    assert tc.memory_bytes(TrainParallel(8, 1, 1), [32768] * 8) > tc.memory_bytes(TrainParallel(8, 1, 1), [4096] * 8)


def test_training_rejects_invalid_layouts():
    tc = TrainCost(load_cluster("a800x16"), Q14)
    with pytest.raises(ValueError, match="does not divide 40 layers"):
        tc.step_time_s(TrainParallel(1, 3, 1), [100] * 3)
    with pytest.raises(ValueError, match="smaller than DP"):
        tc.step_time_s(TrainParallel(2, 1, 4), [100] * 3)
    with pytest.raises(ValueError, match="exceeds a node"):
        tc.step_time_s(TrainParallel(16, 1, 1), [100] * 4)
