"""The paper's scale as a preset (issue 23 build 7): --scale paper is 128 prompts x 16 samples (2,048
trajectories a step) with a 40,960-token cap; --batch-prompts / --group-size still override it."""

import subprocess
import sys
from pathlib import Path

import pytest

from areal_libra.sim.report import make_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("workload", ["search_r1", "dapo_math", "r2e_gym"])
def test_paper_scale_preset(workload):
    env = make_env(workload, "a800x48", "qwen3-14b", scale="paper")
    cfg = env.workload.cfg
    assert (cfg.batch_prompts, cfg.group_size, cfg.max_len) == (128, 16, 40960)
    assert cfg.batch_prompts * cfg.group_size == 2048
    # the explicit flags give the same scale, and still override the preset
    flags = make_env(workload, "a800x48", "qwen3-14b", batch_prompts=128, group_size=16).workload.cfg
    assert (flags.batch_prompts, flags.group_size) == (128, 16)
    mixed = make_env(workload, "a800x48", "qwen3-14b", batch_prompts=64, scale="paper").workload.cfg
    assert (mixed.batch_prompts, mixed.group_size) == (64, 16)
    default = make_env(workload, "a800x48", "qwen3-14b").workload.cfg
    assert default.batch_prompts * default.group_size < 2048


def test_unknown_scale_is_one_line_and_exit_2():
    p = subprocess.run([sys.executable, "-m", "evaluation.throughput", "--workload", "search_r1", "--scale", "huge"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 2 and "invalid choice: 'huge'" in p.stderr
    with pytest.raises(ValueError, match="unknown scale"):
        make_env("search_r1", "a800x48", "qwen3-14b", scale="huge")
