"""The regime map: its points, one small point end to end, the CLI's bad input."""

import subprocess
import sys
from pathlib import Path

import pytest

from areal_libra.sim.regimes import AXES, Point, points, run_point

ROOT = Path(__file__).resolve().parents[2]


def test_points_vary_one_axis_at_a_time_and_run_the_base_once():
    base = Point()
    pts = points(base)
    assert pts[0] == ("base", base)
    assert len(pts) == 1 + sum(len([v for v in vals if v != getattr(base, a)]) for a, vals in AXES.items())
    for axis, p in pts[1:]:
        diff = [k for k in base.__dict__ if getattr(p, k) != getattr(base, k)]
        assert diff == [axis]


def test_a_small_point_reports_both_systems_against_the_roofline():
    r = run_point(Point(gpus=16, tool_s=1.0, cap=16384), steps=3)
    s, lb = r["areal_static_optimal"], r["libra"]
    assert r["libra_over_static"] == pytest.approx(lb["tokens_per_s"] / s["tokens_per_s"])
    assert 0 < r["libra_over_roofline"] < 1 and 0 < r["static_over_roofline"] < 1
    assert 0 < r["tool_time_share"] < 1
    assert r["point"]["gpus"] == 16


def test_cli_bad_axis_exits_2_with_one_line():
    p = subprocess.run([sys.executable, "-m", "evaluation.regimes", "--axes", "tail,colour"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == ["error: unknown axis 'colour'; choose from " + ", ".join(AXES)]
