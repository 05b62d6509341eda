"""Libra's ablation ladder on the simulated cluster (pinned CLI): static_uniform -> +planner (homogeneous TP)
-> +hetero_tp -> +cmlfq -> +elastic. Same arguments and output keys as evaluation/throughput.py."""

from __future__ import annotations

import sys

from areal_libra.sim.report import main_common
from areal_libra.sim.systems import LADDER

if __name__ == "__main__":
    sys.exit(main_common(sys.argv[1:], "Simulated ablation ladder of Libra.", LADDER, "static_uniform"))
