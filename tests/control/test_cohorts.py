"""The complete-cohort history (control.cohorts), shared by the simulator and the live run, and the live run's
source of the oldest running start version (workflows.sink.running / oldest_running)."""

from __future__ import annotations

import asyncio

import pytest

from areal_libra.control.cohorts import CohortHistory
from areal_libra.workflows import sink


def _cohorts() -> CohortHistory:
    c = CohortHistory()
    # completion order: version 1's short trajectories finish before version 0's long tail
    for v, row in ((0, (10, 100)), (1, (10, 20)), (1, (10, 30)), (0, (10, 900)), (2, (10, 40)), (1, (10, 800))):
        c.add(v, row)
    return c


def test_only_versions_below_the_oldest_running_count():
    c = _cohorts()
    assert len(c) == 6
    assert c.history(100, 0) == []  # version 0 still runs: nothing is complete, no re-plan history
    assert c.history(100, 1) == [(10, 100), (10, 900)]  # the whole cohort 0, its tail included
    assert c.history(100, 2) == [(10, 100), (10, 900), (10, 20), (10, 30), (10, 800)]
    assert c.history(100, None) == c.history(100, 3) and len(c.history(100, None)) == 6


def test_newest_whole_cohorts_then_an_even_subsample():
    c = _cohorts()
    # n=3: cohort 1 alone reaches it (3 rows), the older cohort is not read
    assert c.history(3, 2) == [(10, 20), (10, 30), (10, 800)]
    # n=4: cohorts 1 and 0 (5 rows), the older cohort first, cut to 4 by the subsample
    assert c.history(4, 2) == [(10, 100), (10, 900), (10, 20), (10, 30)]
    big = CohortHistory()
    for i in range(10):
        big.add(5, (1, i))
    assert big.history(5, None) == [(1, 0), (1, 2), (1, 4), (1, 6), (1, 8)]  # every other, not the first five


def test_needed_keeps_what_a_later_history_reads():
    c = _cohorts()
    keep = c.needed(3, 2)
    assert sorted(keep) == [1, 2]  # the running cohort 2 and the newest complete ones up to 3 rows
    d = CohortHistory()
    for v, rows in keep.items():
        for r in rows:
            d.add(v, r)
    for n in (1, 2, 3):
        for running in (2, 3, None):
            assert d.history(n, running) == c.history(n, running), (n, running)


def test_sink_tracks_the_oldest_running_start_version():
    async def episode(v: int, gate: asyncio.Event) -> None:
        with sink.running(v):
            await gate.wait()

    async def main() -> None:
        assert sink.oldest_running() is None
        g0, g1, g2 = asyncio.Event(), asyncio.Event(), asyncio.Event()
        t = [asyncio.create_task(episode(v, g)) for v, g in ((0, g0), (0, g0), (1, g1), (2, g2))]
        await asyncio.sleep(0)
        assert sink.oldest_running() == 0
        g0.set()
        await asyncio.gather(t[0], t[1])
        assert sink.oldest_running() == 1
        t[2].cancel()  # an episode cancelled (a weight update's abort, a failed request) leaves the count too
        with pytest.raises(asyncio.CancelledError):
            await t[2]
        assert sink.oldest_running() == 2
        g2.set()
        await t[3]
        assert sink.oldest_running() is None

    asyncio.run(main())
