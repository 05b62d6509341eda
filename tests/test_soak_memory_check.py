"""evaluation.soak's memory check: least-squares growth after the first quarter of a process's samples."""

from __future__ import annotations

from evaluation.soak import MIN_JUDGED_SAMPLES, flat_check, summarize


def _series(seconds: float, rss, every: float = 5.0) -> list[tuple[float, float]]:
    return [(1000.0 + t, rss(t)) for t in [i * every for i in range(int(seconds / every) + 1)]]


def test_a_plateau_after_a_short_warm_up_is_flat_and_a_leak_is_not():
    plateau = _series(400, lambda t: 460.0 if t >= 10 else 370.0)
    assert flat_check(plateau)["flat"] is True
    leak = _series(400, lambda t: 460.0 + 0.2 * t)  # +0.2 MiB/s: 60 MiB over the judged span
    got = flat_check(leak)
    assert got["flat"] is False and 55 < got["growth_mib"] < 65


def test_summary_fails_on_one_growing_process_and_lists_short_lived_ones():
    flat = _series(400, lambda t: 460.0)
    short = _series(5.0 * (MIN_JUDGED_SAMPLES - 2), lambda t: 300.0 + 10 * t)
    leak = _series(400, lambda t: 460.0 + 0.2 * t)
    recs = [{"step": i, "ppo_actor/n_seqs": 4, "ppo_actor/task_reward/avg": 0.1 * i} for i in range(1, 7)]

    def run(rss):
        return summarize(6, 10, 2, 2, recs, [], [], rss, 0.0, 0)

    ok = run({"server:1:2": flat, "trainer:3": flat, "server:4:5": short})
    assert ok["checks"]["memory_flat"] is True
    assert set(ok["memory"]) == {"server:1:2", "trainer:3"} and ok["memory_unjudged_life_s"] == {"server:4:5": 40.0}
    assert run({"server:1:2": flat, "trainer:3": leak})["checks"]["memory_flat"] is False
    assert run({"server:4:5": short})["checks"]["memory_flat"] is False  # nothing judged: not shown flat
