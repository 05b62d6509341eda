"""Issue 23: evaluation.synth_trace --growth G picks the smallest drift whose traces grow G-fold."""

import subprocess
import sys
from pathlib import Path

import pytest

from evaluation.synth_trace import GROWTH_RESOLUTION, SynthConfig, drift_for_growth, generate, length_growth

ROOT = Path(__file__).resolve().parents[2]
SMALL = SynthConfig(n_prompts=16, prompts_per_step=4, samples_per_prompt=4)
STEPS = 12


def _growth(d: float) -> float:
    cfg = SynthConfig(**{**SMALL.__dict__, "gen_drift": d, "calls_drift": d})
    return length_growth(generate(cfg, STEPS, seed=1))


def test_growth_picks_the_smallest_drift_on_its_grid():
    d, g, per_step = drift_for_growth(SMALL, STEPS, 1, 1.5)
    assert g >= 1.5 and g == pytest.approx(_growth(d)) and len(per_step) == STEPS
    assert _growth(round(d - GROWTH_RESOLUTION, 6)) < 1.5  # one grid step less falls short
    # the traces it returns are the generator's at that drift, other fields untouched
    assert per_step == generate(SynthConfig(**{**SMALL.__dict__, "gen_drift": d, "calls_drift": d}), STEPS, 1)
    assert _growth(0.0) < 1.2  # no drift: about flat (the measure is not growth by construction)


def test_length_growth_is_the_mean_generated_tokens_last_over_first():
    per_step = generate(SMALL, STEPS, seed=0)
    mean = [sum(t.model_tokens for t in s) / len(s) for s in per_step]
    # equal-sized steps: the window mean is the mean of the step means
    assert length_growth(per_step) == pytest.approx(sum(mean[-5:]) / sum(mean[:5]))


def _run(*args):
    return subprocess.run([sys.executable, "-m", "evaluation.synth_trace", *map(str, args)],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)


@pytest.mark.parametrize("args, word", [
    (["--growth", "0.5"], "must be > 1"),
    (["--growth", "4", "--steps", "6"], "--steps >= 10"),
    (["--growth", "4", "--set", "gen_drift=0.01"], "gen_drift"),
])
def test_growth_bad_input_is_one_line(tmp_path, args, word):
    r = _run("--out", tmp_path, *args)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and word in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
