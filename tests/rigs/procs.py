"""Which processes a test left behind, read from /proc (processes and threads may exit while we look)."""

from __future__ import annotations

import os


def children(pid: int) -> set[int]:
    """Direct children of `pid` (empty once it has exited)."""
    out: set[int] = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out |= {int(c) for c in f.read().split()}
        except FileNotFoundError:  # a thread that just ended
            continue
    return out


def descendants(pid: int) -> set[int]:
    """Children, grandchildren, ... of `pid`."""
    out: set[int] = set()
    for c in children(pid):
        out |= {c} | descendants(c)
    return out
