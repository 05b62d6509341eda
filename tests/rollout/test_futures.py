"""then_record: the waiter wakes only after the record ran, with the original outcome."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

from areal_libra.rollout.futures import then_record


def test_the_waiter_wakes_after_the_record_even_behind_a_slow_callback() -> None:
    fut: concurrent.futures.Future = concurrent.futures.Future()
    fut.add_done_callback(lambda _: time.sleep(0.3))  # runs before the record
    recorded: list[int] = []
    out = then_record(fut, lambda f: recorded.append(f.result()))
    threading.Thread(target=fut.set_result, args=(7,)).start()
    assert out.result(timeout=10) == 7
    assert recorded == [7]


def test_an_error_reaches_the_waiter_and_a_failing_record_still_resolves() -> None:
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def record(_f: concurrent.futures.Future) -> None:
        raise RuntimeError("bookkeeping failed")

    out = then_record(fut, record)
    fut.set_exception(ValueError("update failed"))
    with pytest.raises(ValueError, match="update failed"):
        out.result(timeout=10)
