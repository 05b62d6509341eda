"""A weight update's bookkeeping must be done before the trainer, waiting on the update's future, moves on.

`concurrent.futures.Future` wakes its waiters before it runs its done-callbacks, so a record kept in a
callback can lag behind the waiter (a reconfiguration right after a step saw the update still in progress).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any


def then_record(fut: concurrent.futures.Future, record: Callable[[concurrent.futures.Future], None]
                ) -> concurrent.futures.Future:
    """A future with `fut`'s outcome that resolves only after `record(fut)` ran (even if it raised)."""
    out: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def done(f: concurrent.futures.Future) -> None:
        try:
            record(f)
        finally:
            if f.cancelled():
                out.cancel()
            elif f.exception() is not None:
                out.set_exception(f.exception())
            else:
                out.set_result(f.result())

    fut.add_done_callback(done)
    return out
