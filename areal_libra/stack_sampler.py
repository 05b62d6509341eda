"""Where a process's CPU time goes, by sampling every thread's Python stack (a diagnostic, no dependency).

    AREAL_LIBRA_PROFILE_TRAINER=/tmp/trainer.json python -m areal_libra.launch ...   # the trainer samples itself

`StackSampler(path).start()` wakes every `interval_s`, reads `sys._current_frames()` and counts, per thread
name, the innermost function of each stack ("self") and every function on it ("inclusive"; a recursive one
once per sample), and charges each thread's CPU seconds since the previous sample (Linux /proc) to the stack
it is in now ("cpu_*": where the CPU went, approximately). Every `write_every_s` and at `stop()` it writes the top entries as JSON (atomic). Samples
are wall-clock, not CPU: a thread blocked in a C call counts at the Python function that made the call; the
"busy" counts leave out stacks whose innermost Python frame is a known wait (threading's wait, a selector's
select, a queue's get, ...); a plain time.sleep in one's own function is not recognised.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from areal_libra.utils import atomic_write_text

ENV = "AREAL_LIBRA_PROFILE_TRAINER"
# Innermost functions that wait rather than compute (leaf frames of an idle thread).
_WAITING = {"select", "poll", "wait", "sleep", "acquire", "_wait_for_tstate_lock", "get", "accept", "recv",
            "recv_into", "readinto", "_worker", "run_forever", "_run_once", "epoll", "wait_for", "_recv"}


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _thread_cpu_s(native_id: int) -> float | None:
    """User + system CPU seconds of one thread of this process (/proc; None elsewhere)."""
    try:
        with open(f"/proc/self/task/{native_id}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14, 15 of stat)
    except (OSError, ValueError, IndexError):
        return None


def _where(code) -> str:
    return f"{code.co_name} ({Path(code.co_filename).name}:{code.co_firstlineno})"


class StackSampler:
    def __init__(self, path: str | Path, interval_s: float = 0.02, write_every_s: float = 20.0, top: int = 60) -> None:
        self.path, self.interval_s, self.write_every_s, self.top = Path(path), interval_s, write_every_s, top
        self.samples = 0
        self.self_counts: Counter[str] = Counter()
        self.busy: Counter[str] = Counter()
        self.inclusive: Counter[str] = Counter()
        self.threads: Counter[str] = Counter()
        self.thread_cpu: Counter[str] = Counter()  # CPU seconds per thread (between samples)
        self.cpu_leaf: Counter[str] = Counter()  # CPU seconds charged to the innermost frame sampled
        self.cpu_inclusive: Counter[str] = Counter()
        self._cpu: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self.t0 = time.monotonic()

    def start(self) -> StackSampler:
        self._thread.start()
        return self

    def sample(self) -> None:
        threads = {t.ident: t for t in threading.enumerate()}
        me = threading.get_ident()
        self.samples += 1
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue
            t = threads.get(ident)
            tname = t.name if t is not None else str(ident)
            # CPU seconds the thread used since the last sample (Linux), charged to the stack it is in now.
            cpu = _thread_cpu_s(t.native_id) if t is not None and t.native_id is not None else None
            used = 0.0
            if cpu is not None:
                used = max(0.0, cpu - self._cpu.get(ident, cpu))
                self._cpu[ident] = cpu
                self.thread_cpu[tname] += used
            leaf = _where(frame.f_code)
            self.threads[tname] += 1
            self.self_counts[f"{tname}: {leaf}"] += 1
            self.cpu_leaf[f"{tname}: {leaf}"] += used
            if frame.f_code.co_name not in _WAITING:
                self.busy[f"{tname}: {leaf}"] += 1
            seen: set[str] = set()
            f = frame
            while f is not None:
                w = _where(f.f_code)
                if w not in seen:
                    seen.add(w)
                    self.inclusive[f"{tname}: {w}"] += 1
                    self.cpu_inclusive[f"{tname}: {w}"] += used
                f = f.f_back

    def write(self) -> None:
        out = {"samples": self.samples, "interval_s": self.interval_s, "wall_s": time.monotonic() - self.t0,
               "threads": dict(self.threads.most_common()),
               "thread_cpu_s": {k: round(v, 2) for k, v in self.thread_cpu.most_common()},
               "cpu_leaf_s": {k: round(v, 2) for k, v in self.cpu_leaf.most_common(self.top)},
               "cpu_inclusive_s": {k: round(v, 2) for k, v in self.cpu_inclusive.most_common(self.top)},
               "busy_leaf": dict(self.busy.most_common(self.top)),
               "leaf": dict(self.self_counts.most_common(self.top)),
               "inclusive": dict(self.inclusive.most_common(self.top))}
        atomic_write_text(self.path, json.dumps(out, indent=1))

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.interval_s):
            self.sample()
            if time.monotonic() - last >= self.write_every_s:
                self.write()
                last = time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.write()
