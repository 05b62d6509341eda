"""C-MLFQ auto mode (cmlfq/auto.py): it is the default, explicit switches still run as given, MLFQ
decides where nothing is learned, the choice is deterministic and made once per step from visible steps
only, and it holds up on three trace families with different causal structure (issue 16)."""

from __future__ import annotations

import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from areal_libra.cmlfq import make_policy
from areal_libra.cmlfq.auto import ALL_REGIONS, format_regions, parse_regions
from areal_libra.cmlfq.replay import decision_points, replay
from areal_libra.cmlfq.tree import cpp_available
from areal_libra.trace import read_traces
from evaluation.synth_trace import SynthConfig, generate
from tests.cmlfq._heavy_tail_trace import BUCKETS as HEAVY_BUCKETS
from tests.cmlfq._heavy_tail_trace import heavy_tail_trace

ROOT = Path(__file__).resolve().parents[2]

POLY = Path("/work/shared/data/polytrace/search_r1")


def _split(trajs, first_eval_step):
    return [t for t in trajs if t.step < first_eval_step], [t for t in trajs if t.step >= first_eval_step]


def test_auto_is_the_default_and_explicit_switches_still_run_as_given():
    assert make_policy("cmlfq", HEAVY_BUCKETS).auto
    assert make_policy("cmlfq", HEAVY_BUCKETS, min_samples=2, start_lookup=False).auto  # untuned switches
    fixed = make_policy("cmlfq", HEAVY_BUCKETS, center=0.5, overrun=True)
    assert not fixed.auto and fixed.config.center == 0.5
    assert not make_policy("cmlfq", HEAVY_BUCKETS, auto=False).auto
    train, _ = _split(heavy_tail_trace(steps=3, per_step=120), 3)
    fixed.fit(train)
    assert fixed.auto_choice is None and (fixed.config.center, fixed.config.overrun) == (0.5, True)
    pinned = make_policy("cmlfq", HEAVY_BUCKETS, auto=True, center=0.5, state_key="")
    pinned.fit(train)
    assert pinned.auto_choice is not None
    assert pinned.auto_choice.switches["center"] == 0.5 and pinned.auto_choice.switches["state_key"] == ""
    assert pinned.config.center == 0.5


def test_mlfq_regions_parse_and_all_regions_is_exactly_mlfq():
    assert parse_regions("") == frozenset() and parse_regions("all") == ALL_REGIONS
    assert parse_regions("0/2o 3") == {(0, False), (2, True), (3, False)}
    assert format_regions(parse_regions("3o/1")) == "1/3o" and format_regions(ALL_REGIONS) == "all"
    assert make_policy("cmlfq", HEAVY_BUCKETS, auto=False, mlfq_at=0).config.mlfq_at == "0"  # CLI value 0
    for bad in ("4", "0o", "x"):
        with pytest.raises(ValueError, match="mlfq_at"):
            parse_regions(bad)
    train, evals = _split(heavy_tail_trace(steps=4, per_step=120), 2)
    mlfq = make_policy("mlfq", HEAVY_BUCKETS)
    mlfq.fit(train)
    tree = make_policy("cmlfq", HEAVY_BUCKETS, auto=False, mlfq_at="all")
    tree.fit(train)
    assert replay(tree, evals) == replay(mlfq, evals)
    assert replay(make_policy("cmlfq", HEAVY_BUCKETS, auto=False), evals) != replay(mlfq, evals)


def test_untrained_auto_decides_like_mlfq_and_a_learned_tree_takes_over():
    trajs = heavy_tail_trace(steps=2, per_step=150)
    pol, mlfq = make_policy("cmlfq", HEAVY_BUCKETS), make_policy("mlfq", HEAVY_BUCKETS)
    for t in trajs[:60]:
        pts = decision_points(t)
        assert pol.start(pts[0]) == mlfq.start(pts[0]) == 0
        for cur in range(len(HEAVY_BUCKETS)):
            for r in pts[1:]:
                assert pol.tool_return(r, cur) == mlfq.tool_return(r, cur)
    pol.fit(trajs)
    assert pol.auto_choice is not None and pol.auto_choice.folds == 2  # two visible steps, one fold each


def test_auto_is_deterministic_chooses_once_per_step_and_sees_visible_steps_only():
    train, evals = _split(heavy_tail_trace(steps=5, per_step=120, seed=3), 3)
    runs = []
    for _ in range(2):
        pol = make_policy("cmlfq", HEAVY_BUCKETS)
        pol.fit(train)
        first = pol.auto_choice.as_dict()
        assert first["steps"] == [0, 1, 2]
        n = len(pol.auto_log)
        pol.end_step()  # no new step became visible: no new choice
        assert len(pol.auto_log) == n
        # route step 3 (its outcomes unseen): the choice must not move while the step runs
        for t in evals:
            if t.step == 3:
                pol.start(decision_points(t)[0])
                pol.finish(t)
        assert pol.auto_choice.as_dict() == first
        pol.end_step()
        assert len(pol.auto_log) == n + 1 and pol.auto_choice.steps == [1, 2, 3]
        runs.append([c.as_dict() for c in pol.auto_log])
    assert runs[0] == runs[1]


@pytest.mark.skipif(not cpp_available(), reason="C++ prefix tree not built")
def test_auto_chooses_the_same_on_both_tree_cores():
    train, evals = _split(heavy_tail_trace(steps=3, per_step=100, seed=5), 2)
    out = []
    for backend in ("cpp", "python"):
        pol = make_policy("cmlfq", HEAVY_BUCKETS, backend=backend)
        pol.fit(train)
        out.append((pol.auto_choice.as_dict(), replay(pol, evals)))
    assert out[0] == out[1]


def _synth_family():
    steps = generate(SynthConfig(n_prompts=48, prompts_per_step=12, samples_per_prompt=16), 8, seed=0)
    return [t for s in steps[:5] for t in s], [t for s in steps[5:] for t in s], [4096, 12288, 32768]


def _heavy_family():
    return (*_split(heavy_tail_trace(steps=6, per_step=250), 3), HEAVY_BUCKETS)


def _search_r1_family():
    if not POLY.is_dir():
        pytest.skip("PolyTrace data not present")
    keep = lambda t: zlib.crc32(t.prompt_id.encode()) % 4 == 0  # noqa: E731 - a quarter of the prompts
    train = [t for t in read_traces([POLY / f"step_{i}.jsonl.gz" for i in range(3)]) if keep(t)]
    evals = [t for t in read_traces([POLY / f"step_{i}.jsonl.gz" for i in (3, 4)]) if keep(t)]
    return train, evals, [1536, 3072, 7168]


@pytest.mark.parametrize("family", ["search_r1", "synth", "heavy_tail"])
def test_auto_is_never_worse_than_mlfq_or_the_predictor(family):
    """Issue 16's bar, on three causal structures: real Search-R1 (a quarter of its prompts; one tool,
    prompts never recur), the project's generator (recurring prompts, drift, per-sample persistence) and
    a heavy-tailed, memoryless trace without recurring prompts (tests/cmlfq/_heavy_tail_trace.py, untuned):
    decision accuracy >= max(MLFQ, predictor) - 0.005 and fewer migrated tokens than MLFQ."""
    train, evals, buckets = {"search_r1": _search_r1_family, "synth": _synth_family, "heavy_tail": _heavy_family}[family]()
    m = {}
    for name in ("cmlfq", "mlfq", "predictor"):
        pol = make_policy(name, buckets)
        pol.fit(train)
        m[name] = replay(pol, evals)
    best = max(m["mlfq"].decision_accuracy, m["predictor"].decision_accuracy)
    assert m["cmlfq"].decision_accuracy >= best - 0.005, (family, m)
    assert m["cmlfq"].migrated_token_ratio < m["mlfq"].migrated_token_ratio, (family, m)
    if family == "heavy_tail":
        # The failure the issue reports: the fixed default switches lose to MLFQ on such a trace.
        fixed = make_policy("cmlfq", buckets, auto=False)
        fixed.fit(train)
        assert replay(fixed, evals).decision_accuracy < m["mlfq"].decision_accuracy


def test_simulator_runs_with_auto():
    p = subprocess.run([sys.executable, "-m", "evaluation.throughput", "--workload", "search_r1",
                        "--cluster", "a800x16", "--model", "qwen3-14b", "--steps", "3", "--json",
                        "--batch-prompts", "4", "--systems", "libra", "--knob", "cmlfq_mode=auto"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert '"tokens_per_s"' in p.stdout


def test_background_validation_chooses_what_the_synchronous_one_does():
    train, evals = _split(heavy_tail_trace(steps=4, per_step=100, seed=7), 3)
    sync = make_policy("cmlfq", HEAVY_BUCKETS)
    sync.fit(train)
    bg = make_policy("cmlfq", HEAVY_BUCKETS, auto_background=True)
    bg.fit(train)
    bg.wait_auto(60)
    assert bg.auto_choice is not None and bg.auto_choice.as_dict() == sync.auto_choice.as_dict()
    assert bg.config.center == sync.config.center and bg.config.state_key == sync.config.state_key
    for t in evals[:50]:
        pts = decision_points(t)
        assert bg.start(pts[0]) == sync.start(pts[0])
        for r in pts[1:]:
            assert bg.tool_return(r, 1) == sync.tool_return(r, 1)
