"""Joint planner behaviour: exact budget, drift toward rollout, larger TP for a long tail, clear errors."""

import random
from dataclasses import replace
from pathlib import Path

import pytest

from areal_libra.cost.presets import ModelSpec, load_cluster
from areal_libra.cost.training import TrainCost
from areal_libra.planner import PlanError, PlannerConfig, sample_history, solve

SEARCH_R1 = Path("/work/shared/data/polytrace/search_r1/step_0.jsonl.gz")


def _random_history(rng, n=400, tail=0.0, tail_len=(20000, 30000)):
    h = []
    for _ in range(n):
        p = rng.randint(100, 800)
        if rng.random() < tail:
            h.append((p, p + rng.randint(*tail_len)))
        else:
            h.append((p, p + rng.randint(100, 2500)))
    return h


@pytest.mark.parametrize("cluster,seed", [("a800x16", 0), ("a800x48", 1), ("h100x24", 2), ("a100x8", 3)])
def test_plan_uses_exactly_the_budget(cluster, seed):
    rng = random.Random(seed)
    plan = solve(cluster, "qwen3-4b" if seed % 2 else "qwen3-14b", _random_history(rng, tail=0.05))
    n = load_cluster(cluster).n_gpus
    assert plan.train_gpus + plan.rollout_gpus + plan.idle_gpus == n
    assert plan.idle_gpus == 0  # TP1 is allowed, so a leftover GPU can always become a server
    assert plan.rollout_gpus == sum(i.tp * i.count for i in plan.instances)
    assert plan.makespan_s == max(plan.t_train_s, plan.t_rollout_s)
    # the predicted times are the cost models' own numbers for the chosen layout
    assert plan.t_train_s == pytest.approx(plan.train_breakdown["total"])
    assert plan.t_rollout_s == max(i.t_s for i in plan.instances)


def test_idle_gpus_are_reported_when_the_budget_cannot_be_spent():
    # Training pinned to 3 GPUs (DP3) and only TP2 rollout servers: 5 rollout GPUs hold two servers, one idles.
    rng = random.Random(5)
    # With fill_tp=() (no smaller TP may take it); by default a TP1 server fills it (issue 23 build 4).
    cfg = PlannerConfig(allowed_tp=(2,), global_batch=192, train_tp=(1,), max_pp=1, min_train_gpus=3,
                        max_train_gpus=3, fill_tp=())
    h = _random_history(rng)
    plan = solve("a800x8", "qwen3-4b", h, cfg)
    assert (plan.train_gpus, plan.rollout_gpus, plan.idle_gpus) == (3, 4, 1)
    assert "1 GPU(s) left idle" in plan.notes[0]
    filled = solve("a800x8", "qwen3-4b", h, replace(cfg, fill_tp=(1, 2)))
    assert (filled.train_gpus, filled.rollout_gpus, filled.idle_gpus) == (3, 5, 0)
    assert dict(filled.tp_counts()) == {1: 1, 2: 2} and not filled.notes


def test_plan_is_no_worse_than_any_other_split():
    """The joint search's makespan is the minimum over every training size of max(T_train, best T_rollout)."""
    rng = random.Random(11)
    hist = _random_history(rng, n=300, tail=0.03)
    cfg = PlannerConfig(global_batch=256)
    plan = solve("a800x16", "qwen3-4b", hist, cfg)
    for g in range(1, 16):
        try:
            other = solve("a800x16", "qwen3-4b", hist, PlannerConfig(global_batch=256, min_train_gpus=g,
                                                                      max_train_gpus=g))
        except PlanError:
            continue
        assert plan.makespan_s <= other.makespan_s + 1e-9


def test_lengthening_moves_gpus_to_rollout():
    """Search-R1 step 0 with every trajectory's generated tokens x4 (tool returns unchanged)."""
    from areal_libra.trace import read_traces

    trajs = read_traces(SEARCH_R1)
    cfg = PlannerConfig(global_batch=2048)
    base = solve("a800x48", "qwen3-14b", [(t.prompt_tokens, t.final_length, t.model_tokens) for t in trajs], cfg)
    longer = solve("a800x48", "qwen3-14b", [(t.prompt_tokens, t.final_length + 3 * t.model_tokens,
                                             4 * t.model_tokens) for t in trajs], cfg)
    assert longer.rollout_gpus > base.rollout_gpus
    assert longer.train_gpus < base.train_gpus
    assert longer.t_rollout_s > base.t_rollout_s
    assert longer.train_gpus + longer.rollout_gpus + longer.idle_gpus == 48


def test_long_tail_gets_larger_tp_at_the_long_end():
    rng = random.Random(2)
    short = _random_history(rng, n=1000)
    tail = short + [(300, 300 + rng.randint(20000, 30000)) for _ in range(50)]
    plan = solve("a800x48", "qwen3-14b", tail)
    buckets = plan.buckets()
    assert buckets[-1][0] >= max(f for _, f in tail)  # the last bucket holds the longest request
    assert buckets[-1][1] > buckets[0][1]  # long end on a larger TP than the short end
    assert buckets[-1][1] >= 4


def test_model_that_cannot_train_anywhere_names_memory():
    with pytest.raises(PlanError, match="memory"):
        solve("a800x8", "qwen3-32b", [(100, 2000)] * 50)


def test_model_that_cannot_roll_out_names_weights():
    huge = ModelSpec("huge", n_layers=120, hidden=16384, n_heads=128, n_kv_heads=8, head_dim=128, ffn=65536,
                     vocab=150000)
    with pytest.raises(PlanError, match="does not fit any rollout server: weights"):
        solve("a800x64", huge, [(100, 2000)] * 50)


def test_request_longer_than_any_kv_cache_is_an_error():
    with pytest.raises(PlanError, match="exceeds the KV capacity"):
        solve("a800x16", "qwen3-14b", [(100, 2000)] * 50 + [(100, 20_000_000)], PlannerConfig(allowed_tp=(1,)))


@pytest.mark.parametrize(
    "cluster,history,cfg,needle",
    [
        ("a800x1", [(1, 2)], PlannerConfig(), "at least 1 training and 1 rollout GPU"),
        ("a800x16", [(1, 2)], PlannerConfig(allowed_tp=(1, 16)), "larger than a node"),
        ("a800x16", [], PlannerConfig(), "history is empty"),
        ("a800x16", [(5, 2)], PlannerConfig(), "bad history entry"),
    ],
)
def test_bad_input(cluster, history, cfg, needle):
    with pytest.raises(PlanError, match=needle):
        solve(cluster, "qwen3-4b", history, cfg)


def test_alloc_strings_and_buckets():
    rng = random.Random(4)
    plan = solve("a800x48", "qwen3-14b", _random_history(rng, tail=0.05))
    t = plan.train
    assert plan.train_alloc() == f"megatron:d{t.dp}t{t.tp}p{t.pp}"
    groups = plan.rollout_alloc().split(":", 1)[1].split("+")
    tps = [int(g.split("t")[1]) for g in groups]
    assert tps == sorted(set(tps))
    assert sum(int(g[1:].split("t")[0]) * int(g.split("t")[1]) for g in groups) == plan.rollout_gpus
    th = [b[0] for b in plan.buckets()]
    assert th == sorted(th) and len(set(th)) == len(th)
    j = plan.to_json()
    assert set(j) == {"train", "rollout", "t_train_s", "t_rollout_s", "makespan_s", "solve_s"}
    assert set(j["train"]) == {"gpus", "tp", "pp", "dp", "ep", "micro_batch", "backend"}
    assert set(j["rollout"]) == {"gpus", "instances", "backend"}


def test_moe_plan_uses_expert_parallel_alloc():
    rng = random.Random(8)
    plan = solve("a800x48", "qwen3-30b-a3b", _random_history(rng))
    if plan.train.ep > 1:
        assert plan.train_alloc().startswith("megatron:(attn:")
    assert plan.to_json()["train"]["ep"] == plan.train.ep


def test_stratified_sample_keeps_work_and_tail():
    rng = random.Random(9)
    hist = _random_history(rng, n=1000, tail=0.02)
    p, o, w, lo, hi = sample_history(hist, 64, 512)
    assert len(p) == 64 and w.sum() == pytest.approx(512)
    finals = sorted(f for _, f in hist)
    # The tail sample is the top n / (B + 1) requests (2 of 1,000 for B = 512): their mean, the expected
    # longest request of one batch, not the longest of the whole history; its stratum ends at the longest.
    assert p[-1] + o[-1] == pytest.approx((finals[-1] + finals[-2]) / 2)
    assert hi[-1] == finals[-1] and lo[-1] == finals[-2]
    assert all((p + o)[i] <= (p + o)[i + 1] for i in range(63))
    assert (p * w).sum() / 512 == pytest.approx(sum(q for q, _ in hist) / len(hist))  # work kept
    assert (o * w).sum() / 512 == pytest.approx(sum(f - q for q, f in hist) / len(hist))
    # A history of about one batch keeps the longest request as its own sample.
    p1, o1, w1, _, _ = sample_history(hist[:300], 64, 300)
    assert p1[-1] + o1[-1] == max(f for _, f in hist[:300]) and w1[-1] == pytest.approx(1.0)


def test_training_time_is_for_the_global_batch():
    from areal_libra.cost.presets import load_model
    from areal_libra.cost.training import BatchStats

    rng = random.Random(1)
    hist = _random_history(rng)
    finals = [f for _, f in hist]
    for gb in (128, 512):
        plan = solve("a800x16", "qwen3-4b", hist, PlannerConfig(global_batch=gb))
        st = BatchStats(gb, gb * sum(finals) / len(finals), gb * sum(f * f for f in finals) / len(finals), max(finals))
        expect = TrainCost(load_cluster("a800x16"), load_model("qwen3-4b")).step_time_s(plan.train, st)
        assert plan.t_train_s == pytest.approx(expect, rel=1e-12)


def test_model_tokens_move_tool_returns_from_decode_to_prefill():
    """(prompt, final, model_tokens) entries decode only the model tokens: same lengths, less rollout time."""
    rng = random.Random(6)
    three = []
    for _ in range(300):
        p, gen, payload = rng.randint(100, 400), rng.randint(50, 400), rng.randint(200, 2000)
        three.append((p, p + gen + payload, gen))
    two = [(p, f) for p, f, _ in three]
    cfg = PlannerConfig(global_batch=256, min_train_gpus=8, max_train_gpus=8)
    a, b = solve("a800x16", "qwen3-4b", two, cfg), solve("a800x16", "qwen3-4b", three, cfg)
    assert b.t_rollout_s < a.t_rollout_s
    assert a.t_train_s == b.t_train_s  # training sees the same sequence lengths
    with pytest.raises(PlanError, match="model_tokens"):
        solve("a800x16", "qwen3-4b", [(100, 200, 150)])


def test_price_reproduces_the_plan_and_tracks_drift():
    from areal_libra.planner.evaluate import price

    rng = random.Random(12)
    hist = _random_history(rng, n=2000, tail=0.03)
    plan = solve("a800x48", "qwen3-14b", hist)
    same = price(plan, "a800x48", "qwen3-14b", hist)
    assert same.t_train_s == pytest.approx(plan.t_train_s, rel=1e-12)
    assert same.t_rollout_s == pytest.approx(plan.t_rollout_s, rel=1e-6)
    longer = [(p, p + 2 * (f - p)) for p, f in hist]
    drift = price(plan, "a800x48", "qwen3-14b", longer)
    assert drift.t_rollout_s > same.t_rollout_s and drift.t_train_s > same.t_train_s
    # re-planning for the drifted history can only help
    assert solve("a800x48", "qwen3-14b", longer).makespan_s <= drift.makespan_s + 1e-9
