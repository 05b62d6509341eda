"""Re-plan triggers and the apply gate."""

import pytest

from areal_libra.planner.replan import ReplanConfig, ReplanPolicy


def test_periodic_trigger():
    pol = ReplanPolicy(ReplanConfig(every_k=10))
    fired = [s for s in range(1, 31) if pol.should_replan(s, 0.1, 0.1, 10.0, 10.0)]
    assert fired == [10, 20, 30]
    assert "periodic" in pol.last_reason


@pytest.mark.parametrize(
    "kw,reason",
    [
        ({"queue_pressure": 0.75}, "queue pressure"),
        ({"active_pressure": 0.9}, "active rollout pressure"),
        ({"t_rollout_s": 12.5, "t_train_s": 10.0}, "ratio"),
        ({"t_rollout_s": 10.0, "t_train_s": 12.5}, "ratio"),
    ],
)
def test_early_triggers(kw, reason):
    pol = ReplanPolicy()
    args = {"queue_pressure": 0.0, "active_pressure": 0.0, "t_rollout_s": 10.0, "t_train_s": 10.0} | kw
    assert pol.should_replan(3, **args)
    assert reason in pol.last_reason


def test_no_trigger_below_thresholds():
    pol = ReplanPolicy()
    assert not pol.should_replan(3, 0.74, 0.84, 12.4, 10.0)


def test_cooldown_limits_early_triggers():
    pol = ReplanPolicy(ReplanConfig(cooldown_steps=3))
    assert pol.should_replan(1, queue_pressure=0.9)
    assert not pol.should_replan(2, queue_pressure=0.9)
    assert not pol.should_replan(4, queue_pressure=0.9)
    assert pol.should_replan(5, queue_pressure=0.9)


def test_gate():
    pol = ReplanPolicy(ReplanConfig(min_gain=0.05, reconfig_cost_s=15.0))
    assert not pol.accept(100.0, 90.0)  # gain 10 s < 15 s cost
    assert pol.accept(100.0, 80.0)  # gain 20 s > 15 s, 20% >= 5%
    assert not pol.accept(1000.0, 980.0)  # gain 20 s > cost but only 2%
    assert pol.accept(100.0, 90.0, reconfig_cost_s=5.0)  # explicit cost
    assert not pol.accept(100.0, 110.0)
    long = ReplanPolicy(ReplanConfig(reconfig_cost_s=120.0, horizon_steps=10))
    assert long.accept(100.0, 80.0)  # 20 s x 10 steps > 120 s
    assert not long.accept(100.0, 90.0, reconfig_cost_s=120.0)  # 10 x 10 = 100 < 120


def test_config_validation():
    with pytest.raises(ValueError):
        ReplanConfig(every_k=0)
    with pytest.raises(ValueError):
        ReplanConfig(ratio=0.5)
