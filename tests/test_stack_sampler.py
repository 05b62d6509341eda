"""areal_libra/stack_sampler.py: a busy thread's function tops the samples, a waiting one is not busy."""

from __future__ import annotations

import json
import threading
import time

from areal_libra.stack_sampler import StackSampler


def _spin(until: threading.Event) -> None:
    t0 = time.monotonic()
    x = 0
    while not until.is_set() and time.monotonic() - t0 < 30:
        for i in range(200):  # a plain loop: a generator's frame would not link back to _spin
            x += i * i


def test_the_busy_thread_is_where_the_samples_are(tmp_path) -> None:
    # Run until the sampler has its samples, not for a fixed time: on a loaded machine the sampler thread
    # gets the GIL less often than its interval.
    done = threading.Event()
    busy = threading.Thread(target=_spin, args=(done,), name="busy")
    idle = threading.Thread(target=done.wait, args=(30,), name="idle")
    # Every function of every thread is counted; the file keeps the `top` most common, and in the full suite the
    # threads earlier tests left running (each with its bootstrap frames) can push _spin out of the default 60.
    sampler = StackSampler(tmp_path / "s.json", interval_s=0.005, top=100_000).start()
    busy.start()
    idle.start()
    t0 = time.monotonic()
    while (sampler.samples <= 20 or time.monotonic() - t0 < 0.3) and time.monotonic() - t0 < 30:
        time.sleep(0.05)
    done.set()
    busy.join()
    idle.join()
    sampler.stop()
    out = json.loads((tmp_path / "s.json").read_text())
    assert out["samples"] > 10
    spin = sum(n for k, n in out["inclusive"].items() if k.startswith("busy: _spin"))
    assert spin >= 0.5 * out["threads"]["busy"]
    assert out["threads"]["idle"] > 10
    # The CPU went to the busy thread, charged to its own function.
    assert out["thread_cpu_s"]["busy"] > 0.05 and out["thread_cpu_s"].get("idle", 0.0) < 0.05
    assert max(out["cpu_inclusive_s"], key=out["cpu_inclusive_s"].get).startswith("busy: ")
    assert not any(k.startswith("idle:") for k in out["busy_leaf"])  # a wait does not compute
