"""The training decision tree returns the same best layout as exhaustive enumeration."""

import random

import pytest

from areal_libra.cost.presets import load_cluster, load_model
from areal_libra.cost.training import BatchStats, TrainCost
from areal_libra.planner.train_tree import TreeConfig, exhaustive, search


@pytest.mark.parametrize("model", ["qwen3-4b", "qwen3-14b", "qwen3-32b", "qwen3-30b-a3b"])
def test_tree_matches_exhaustive(model):
    rng = random.Random(model)
    cost = TrainCost(load_cluster("a800x64"), load_model(model))
    cfg = TreeConfig()
    for gpus in (4, 8, 16, 24, 32, 64):
        n = rng.choice([64, 128, 256])
        lens = [rng.randint(200, rng.choice([4000, 16000, 40000])) for _ in range(n)]
        st = BatchStats.of(lens)
        res = search(cost, gpus, st, cfg)
        ref, ref_t = exhaustive(cost, gpus, st, cfg)
        assert res.best == ref, (model, gpus, res.best, ref)
        if ref is not None:
            assert res.t_s == ref_t
            assert res.best.gpus == gpus


def test_tree_records_prune_reasons():
    cost = TrainCost(load_cluster("a800x64"), load_model("qwen3-32b"))
    res = search(cost, 16, BatchStats.of([8000] * 128), TreeConfig())
    kinds = {r.kind for r in res.log}
    assert "memory" in kinds  # TP1/TP2 cannot hold 32B on 16 GPUs
    assert all(r.reason and r.level in ("TP", "EP", "PP", "DP/mb") for r in res.log)
    assert res.best is not None and res.evaluated >= 1


def test_the_solver_cache_tells_every_cost_model_apart():
    """solve._search caches the tree's results by TrainCost.identity: a model that differs in any field it
    prices with gets its own search, never another model's cached result."""
    import dataclasses

    from areal_libra.planner.solve import _search

    base = TrainCost(load_cluster("a800x64"), load_model("qwen3-14b"))
    priced = [f.name for f in dataclasses.fields(TrainCost) if f.compare]
    assert set(priced) >= {"cluster", "model", "recompute", "logprob_passes", "dp_overlap"}
    assert "_stats_cache" not in priced
    st, cfg = BatchStats.of([6000] * 128), TreeConfig()
    variants = {"recompute": False, "logprob_passes": 3, "dp_overlap": 0.0,
                "model": load_model("qwen3-32b"), "cluster": load_cluster("h200x64")}
    assert set(variants) == set(priced)  # a new priced field needs a variant here
    _search(base, 16, st, cfg)
    for name, value in variants.items():
        other = dataclasses.replace(base, **{name: value})
        assert other.identity != base.identity, name
        got, ref = _search(other, 16, st, cfg), search(other, 16, st, cfg)
        assert (got.best, got.t_s) == (ref.best, ref.t_s), name
