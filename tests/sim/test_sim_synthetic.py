"""The regime map's workload generator: its knobs do what they say."""

import random
import statistics

import pytest

from areal_libra.sim.synthetic import SyntheticAgentic, SynthParams
from areal_libra.sim.workloads import WorkloadConfig


def _gen(params, version=0, n=300, **cfg):
    wl = SyntheticAgentic(WorkloadConfig(group_size=4, batch_prompts=4, **cfg), params)
    rng = random.Random(3)
    return [t for _ in range(n) for t in wl.sample_group(version, rng)]


@pytest.mark.parametrize("tail", [1.5, 4.0, 12.0])
def test_tail_is_p99_over_median(tail):
    trajs = _gen(SynthParams(tail=tail, median_tokens=2000), max_len=10**7)
    toks = sorted(t.model_tokens for t in trajs)
    p99 = toks[int(0.99 * len(toks))]
    assert p99 / statistics.median(toks) == pytest.approx(tail, rel=0.25)


def test_drift_grows_lengths_and_cap_truncates():
    base = statistics.mean(t.model_tokens for t in _gen(SynthParams(), 0, drift=1.0, horizon=10, max_len=10**7))
    late = statistics.mean(t.model_tokens for t in _gen(SynthParams(), 10, drift=1.0, horizon=10, max_len=10**7))
    assert late / base == pytest.approx(2.0, rel=0.15)
    capped = _gen(SynthParams(tail=8.0), max_len=8192)
    assert max(t.final_length for t in capped) <= 8192
    assert any(t.finish_reason == "length" for t in capped)


def test_tool_latency_and_turns():
    trajs = _gen(SynthParams(tool_s=3.0, tokens_per_turn=500), n=100, max_len=10**7)
    lats = [s.tool.latency_s for t in trajs for s in t.segments if s.tool is not None]
    assert statistics.median(lats) == pytest.approx(3.0, rel=0.2)
    assert all(t.segments[-1].tool is None for t in trajs)
    none = _gen(SynthParams(tool_s=0.0), n=20, max_len=10**7)
    assert all(s.tool.latency_s == 0.0 for t in none for s in t.segments if s.tool is not None)
    with pytest.raises(ValueError):
        SynthParams(tail=0.5).check()
