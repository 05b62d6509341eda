"""areal_libra.sim.seeds: the t quantile and the per-seed paired comparison of a ladder."""

import math

import pytest

from areal_libra.sim.seeds import paired_changes, t_quantile_975

# Student's t, 0.975 quantile, from the standard tables.
TABLE = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 9: 2.262, 10: 2.228, 20: 2.086, 30: 2.042, 120: 1.980}


@pytest.mark.parametrize("df,ref", sorted(TABLE.items()))
def test_t_quantile_matches_the_table(df, ref):
    assert t_quantile_975(df) == pytest.approx(ref, rel=2e-3)


def test_t_quantile_refuses_no_degrees_of_freedom():
    with pytest.raises(ValueError, match="df >= 1"):
        t_quantile_975(0)


def test_paired_changes_by_seed():
    runs = {0: {"low": 100.0, "mid": 110.0, "top": 99.0},
            1: {"low": 200.0, "mid": 190.0, "top": 199.5},
            2: {"low": 50.0, "mid": 55.0, "top": 55.0}}
    out = paired_changes(runs, ["low", "mid", "top"])
    assert set(out) == {"mid", "top"} and out["mid"]["against"] == "low"
    mid = out["mid"]
    assert mid["per_seed_pct"] == pytest.approx({"0": 10.0, "1": -5.0, "2": 10.0})
    assert mid["mean_pct"] == pytest.approx(5.0)
    sd = math.sqrt(((5.0) ** 2 + (-10.0) ** 2 + 5.0**2) / 2)
    assert mid["sd_pct"] == pytest.approx(sd)
    half = 4.303 * sd / math.sqrt(3)
    assert mid["ci95_pct"] == pytest.approx([5.0 - half, 5.0 + half], rel=1e-3)
    assert mid["seeds_below_floor"] == [1]
    top = out["top"]  # against mid, seed by seed: -10%, +5%, 0%
    assert top["per_seed_pct"] == pytest.approx({"0": -10.0, "1": 5.0, "2": 0.0})
    assert top["seeds_below_floor"] == [0]


def test_one_seed_has_no_interval():
    out = paired_changes({3: {"a": 10.0, "b": 9.95}}, ["a", "b"])
    assert out["b"]["mean_pct"] == pytest.approx(-0.5) and out["b"]["sd_pct"] is None
    assert out["b"]["ci95_pct"] is None and out["b"]["seeds_below_floor"] == []
