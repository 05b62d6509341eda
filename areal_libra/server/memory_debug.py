"""Where an embedded server's memory is (debug only: AREAL_LIBRA_MEM_DEBUG=1 or 2 in the server's environment).

With the flag, /get_server_info carries ``memory_debug``: glibc's allocator counters (bytes in use vs held
free in the heap vs mmapped), the live object count, and the sizes of the engine's own caches; with 2 also
Python's traced allocations (tracemalloc, started at import) and the top allocation sites (slow: the server
runs several times slower). evaluation.server_memory
reads it to tell a leak (in-use bytes or a cache that keeps growing) from allocator retention (free bytes
the heap keeps, which shows in RSS but is reused).
"""

from __future__ import annotations

import ctypes
import gc
import os
import tracemalloc
from typing import Any

LEVEL = os.environ.get("AREAL_LIBRA_MEM_DEBUG", "")
ENABLED = LEVEL not in ("", "0")
if LEVEL == "2" and not tracemalloc.is_tracing():
    tracemalloc.start(1)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _mallinfo() -> dict[str, float]:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        m = libc.mallinfo2()
    except (OSError, AttributeError):  # not glibc >= 2.33
        return {}
    mib = 2**20
    return {"heap_mib": m.arena / mib, "in_use_mib": m.uordblks / mib, "free_in_heap_mib": m.fordblks / mib,
            "mmapped_mib": m.hblkhd / mib, "mmapped_chunks": m.hblks}


def snapshot(engine: Any, top: int = 8) -> dict[str, Any]:
    """The allocator, Python and engine-cache figures of this process now."""
    out: dict[str, Any] = {"malloc": {k: round(v, 2) for k, v in _mallinfo().items()}}
    if tracemalloc.is_tracing():
        cur, peak = tracemalloc.get_traced_memory()
        stats = tracemalloc.take_snapshot().statistics("lineno")[:top]
        out["python_traced_mib"] = round(cur / 2**20, 2)
        out["python_top"] = [[str(s.traceback[0]), round(s.size / 2**20, 3), s.count] for s in stats]
    out["gc_objects"] = len(gc.get_objects())
    pc = engine.prefix_cache
    out["engine"] = {
        "prefix_cache_entries": 0 if pc is None else len(pc),
        "prefix_cache_tokens": 0 if pc is None else pc.tokens,
        "stop_candidate_cache": len(engine._candidate_cache),
        "rows": len(engine.row_req),
        "waiting": len(engine._waiting),
        "kv_cache_mib": round(engine.cache.nbytes() / 2**20, 2),
    }
    return out
