"""Version aging (earliest deadline first): the order a rollout server admits its waiting requests in."""

from collections import deque

from areal_libra.cmlfq.aging import edf_insert, priority, select_batch


def _order(versions):
    q: deque = deque()
    for i, v in enumerate(versions):
        edf_insert(q, (v, i), priority(v), lambda item: item[0])
    return list(q)


def test_oldest_version_first_and_first_come_first_served_within_a_version():
    assert _order([3, 3, 1, 2, 1, 3, 0]) == [(0, 6), (1, 2), (1, 4), (2, 3), (3, 0), (3, 1), (3, 5)]


def test_the_newest_version_appends():
    assert _order([0, 1, 2, 2]) == [(0, 0), (1, 1), (2, 2), (2, 3)]


# select_batch: the trainer's consumption rule (simulator and live executor alike). Tasks are
# (name, start version, finished) in start order.
def test_areal_rule_takes_the_first_finished_and_leaves_a_straggler():
    tasks = [("a", 0, False), ("b", 0, True), ("c", 1, True), ("d", 2, True)]
    assert select_batch(tasks, 5, None, 2) == (["b", "c"], "")
    assert select_batch(tasks, 5, None, 4) == (None, "count")


def test_bounded_rule_waits_only_for_a_group_at_the_bound():
    # version 5, eta 4: a group of version <= 1 would exceed eta after this step
    assert select_batch([("a", 1, False), ("b", 2, True), ("c", 2, True)], 5, 4, 2) == (None, "stale")
    # a running group of version 2 is not at the bound: no wait, the finished ones go
    assert select_batch([("a", 2, False), ("b", 2, True), ("c", 3, True)], 5, 4, 2) == (["b", "c"], "")


def test_bounded_rule_puts_every_group_at_the_bound_first_and_fills_oldest_first():
    tasks = [("a", 0, True), ("b", 2, True), ("c", 1, True), ("d", 3, True)]
    assert select_batch(tasks, 5, 4, 3) == (["a", "c", "b"], "")
    # more groups at the bound than a batch: all of them (the simulator's batch grows)
    assert select_batch(tasks, 5, 4, 1) == (["a", "c"], "")


def test_bounded_rule_keeps_every_trained_lag_within_eta_on_a_heavy_tail():
    # A tick-by-tick replay: rollout starts groups up to AReaL's admission bound; group i takes durations[i]
    # ticks; the trainer takes one tick per step. Under the rule no consumed group is older than eta; under
    # AReaL's rule the long groups are.
    batch, eta, steps = 2, 2, 40
    durations = [1 if i % 7 else 9 for i in range(steps * batch)]
    for rule_eta, within in ((eta, True), (None, False)):
        started: list[tuple[int, int, int]] = []  # (id, start version, start tick)
        consumed: set[int] = set()
        lags: list[int] = []
        version = t = 0
        while version < steps - eta - 2:
            while len(started) < (version + eta + 1) * batch:  # AReaL's admission bound
                started.append((len(started), version, t))
            t += 1
            tasks = [(i, v, t - t0 >= durations[i]) for i, v, t0 in started if i not in consumed]
            got, _ = select_batch(tasks, version, rule_eta, batch)
            if got is None:
                continue  # the trainer waits a tick
            consumed.update(got)
            lags += [version - started[i][1] for i in got]
            version += 1
        assert (max(lags) <= eta) is within, (rule_eta, max(lags))
