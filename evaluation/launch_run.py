"""One real launch for the live benchmarks (live_ab, live_elastic): run it, return its run directory."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path


class RunError(RuntimeError):
    """The run failed or wrote nothing usable (one line for the user)."""


def launch_run(args: list[str], label: str, log: Callable[[str], None]) -> Path:
    """`python -m areal_libra.launch ARGS`; the run directory it printed. RunError names `label` on failure."""
    log(f"[{label}] {' '.join(args)}")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "areal_libra.launch", *args], capture_output=True, text=True)
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RunError(f"the {label} run failed (exit {r.returncode}): {tail}")
    run_dir = next((line.split("run directory ", 1)[1].strip() for line in r.stdout.splitlines()
                    if "run directory " in line), None)
    if run_dir is None:
        raise RunError(f"the {label} run did not print its run directory")
    log(f"[{label}] done in {time.monotonic() - t0:.0f} s ({run_dir})")
    return Path(run_dir)
