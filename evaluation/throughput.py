"""Throughput of the systems the paper compares, on the simulated cluster (pinned CLI).

python evaluation/throughput.py --workload {search_r1,dapo_math,r2e_gym,PATH} --cluster a800x48 \
    --model qwen3-14b --steps N [--seed S] [--json] [--systems ...] [--plot OUT.png]
"""

from __future__ import annotations

import sys

from areal_libra.sim.report import main_common
from areal_libra.sim.systems import SYSTEMS

if __name__ == "__main__":
    sys.exit(main_common(sys.argv[1:], "Simulated throughput: verl / AReaL baselines vs Libra.", SYSTEMS,
                         "areal_static_optimal"))
