"""Version aging (earliest deadline first): the order a rollout server admits its waiting requests in."""

from collections import deque

from areal_libra.cmlfq.aging import edf_insert, priority


def _order(versions):
    q: deque = deque()
    for i, v in enumerate(versions):
        edf_insert(q, (v, i), priority(v), lambda item: item[0])
    return list(q)


def test_oldest_version_first_and_first_come_first_served_within_a_version():
    assert _order([3, 3, 1, 2, 1, 3, 0]) == [(0, 6), (1, 2), (1, 4), (2, 3), (3, 0), (3, 1), (3, 5)]


def test_the_newest_version_appends():
    assert _order([0, 1, 2, 2]) == [(0, 0), (1, 1), (2, 2), (2, 3)]
