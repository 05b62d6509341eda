"""ElasticPolicy's overshoot check: with the pool sizes given, a move that the next decision would undo is
not made; without them the thresholds alone decide (the previous behaviour)."""

from areal_libra.elastic.policy import ElasticConfig, ElasticPolicy

POL = ElasticPolicy(ElasticConfig(join_ratio=1.15, release_ratio=0.90))


def test_release_that_would_overshoot_is_held():
    # ratio 0.85 with 4 replicas training and 32 rollout GPUs, a 4-GPU replica: after the release
    # 0.85 * 4/3 * 36/32 = 1.275 >= 1.15, so the next decision would join it back.
    d = POL.decide(0.85, 1.0, 0.1, n_active=1, n_idle=0, train_replicas=4, rollout_gpus=32, unit_gpus=4)
    assert d.action == "hold" and "after releasing" in d.reason
    # The thresholds alone release it.
    assert POL.decide(0.85, 1.0, 0.1, n_active=1, n_idle=0).action == "release"


def test_release_that_lands_in_the_band_is_made():
    # 0.5 * 4/3 * 36/32 = 0.75: still rollout-bound afterwards, the release stands.
    d = POL.decide(0.5, 1.0, 0.1, n_active=1, n_idle=0, train_replicas=4, rollout_gpus=32, unit_gpus=4)
    assert d.action == "release" and d.n == 1


def test_join_that_would_overshoot_is_held_and_a_large_imbalance_joins():
    # 1.2 * 3/4 * 28/32 = 0.79 <= 0.90: joining would make rollout the bottleneck at once.
    d = POL.decide(1.2, 1.0, 0.1, n_active=0, n_idle=1, train_replicas=3, rollout_gpus=32, unit_gpus=4)
    assert d.action == "hold" and "after joining" in d.reason
    # 2.0 * 3/4 * 28/32 = 1.31: training stays the bottleneck after the join, so it is worth it.
    d = POL.decide(2.0, 1.0, 0.1, n_active=0, n_idle=1, train_replicas=3, rollout_gpus=32, unit_gpus=4)
    assert d.action == "join" and d.n == 1


def test_pressure_protection_ignores_the_projection():
    d = POL.decide(0.85, 1.0, 0.95, n_active=1, n_idle=0, train_replicas=2, rollout_gpus=4, unit_gpus=4)
    assert d.action == "release"
