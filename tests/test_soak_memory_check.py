"""evaluation.soak's memory check: a rollout server is judged only after its measured warm-up."""

from __future__ import annotations

from evaluation.soak import SERVER_WARMUP_S, memory_check


def _series(seconds: float, rss, every: float = 5.0) -> list[tuple[float, float]]:
    return [(1000.0 + t, rss(t)) for t in [i * every for i in range(int(seconds / every) + 1)]]


def ramp_then_flat(t: float) -> float:
    return 300.0 + 600.0 * min(t, 250.0) / 250.0  # a server's warm-up to 900 MiB, then flat


def test_server_warm_up_is_not_judged_as_growth():
    s = _series(600, ramp_then_flat)
    assert memory_check("server:1:2", s)["flat"] is True
    # the same samples under the first-quarter warm-up (other processes) read as growth
    assert memory_check("trainer:3", s)["flat"] is False


def test_short_lived_server_is_unjudged_and_a_leaking_one_fails():
    assert memory_check("server:1:2", _series(SERVER_WARMUP_S, ramp_then_flat))["flat"] is None
    leak = _series(900, lambda t: ramp_then_flat(t) + 0.2 * t)  # +0.2 MiB/s after the warm-up
    assert memory_check("server:1:2", leak)["flat"] is False
