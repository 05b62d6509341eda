"""AReaL-Static-Optimal's sweep (issue 23 build 1): candidates, a stationary replay of the initial workload,
a steady measurement window after warm-up, and a cache per workload, cluster, scale and seed."""

import json
import random

import pytest

from areal_libra.sim import systems as S
from areal_libra.sim.report import make_env
from areal_libra.sim.workloads import Workload, WorkloadConfig, make_workload


class _Recorder(Workload):
    """Delegates to a real workload and records the policy versions it is asked for."""

    name = "recorder"

    def __init__(self):
        super().__init__(WorkloadConfig(group_size=2, batch_prompts=2))
        self.inner = make_workload("dapo_math", WorkloadConfig(group_size=2, batch_prompts=2))
        self.asked: list[int] = []

    def sample_group(self, version, rng):
        self.asked.append(version)
        return self.inner.sample_group(version, rng)


def test_stationary_replay_never_sees_later_steps():
    base = _Recorder()
    rep = S.StationaryReplay(base)
    rng = random.Random(0)
    for v in range(0, 200, 3):
        assert rep.sample_group(v, rng)
    assert set(base.asked) == set(range(S.SWEEP_REPLAY))  # every one of steps 0..4, nothing later


def test_steady_window_excludes_warmup():
    # steps 0..20: warm-up steps are fast (1 s), the steady ones take 2 s; 100 tokens each
    recs, t = [], 0.0
    for k in range(21):
        t += 1.0 if k < 5 else 2.0
        recs.append({"step": k, "t_end": t, "tokens": 100})
    assert S.steady_tokens_per_s(recs) == pytest.approx(16 * 100 / 32.0)
    with pytest.raises(S.SimError):
        S.steady_tokens_per_s(recs[:10])


def test_candidates_allow_dp_that_does_not_divide_the_batch():
    env = make_env("r2e_gym", "a800x48", "qwen3-14b")  # 16 x 8 = 128 trajectories per step
    cands = S.sweep_candidates(env)
    rolls = {r for r, _ in cands}
    assert rolls == set(range(4, 45, 4))
    assert {tp for r, tp in cands if r == 24} == {1, 2, 4, 8} and {tp for r, tp in cands if r == 4} == {1, 2, 4}
    train = S.split_layout(env, 24, 8).train
    assert train.gpus == 24 and 128 % train.dp != 0  # e.g. TP2 x DP12


def test_sweep_is_cached_per_seed_and_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_LIBRA_CACHE", str(tmp_path))
    env = make_env("search_r1", "a800x16", "qwen3-14b", seed=0, batch_prompts=2, group_size=2)
    full = S.sweep_candidates(env)
    some = [full[0], full[-1]]  # two real candidates keep the test short
    monkeypatch.setattr(S, "sweep_candidates", lambda e: some)
    first = S.static_sweep(env, jobs=1)
    assert first and all(c["tokens_per_s"] > 0 for c in first)
    assert {(c["rollout_gpus"], c["tp"]) for c in first} == set(some)
    files = list((tmp_path / "static_sweep").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["candidates"] == first

    def boom(*a, **k):
        raise AssertionError("the cached sweep was measured again")

    monkeypatch.setattr(S, "measure_candidate", boom)
    assert S.static_sweep(env, jobs=1) == first  # read back from the cache
    spec = S.areal_static_optimal(env)
    best = max(first, key=lambda c: c["tokens_per_s"])
    assert spec.layout.rollout_gpus == best["rollout_gpus"]
    assert {tp for tp, _ in spec.layout.servers} == {best["tp"]}
    assert spec.extra["baseline_candidates"] == first
    # another seed is another cache entry (and would be measured)
    env1 = make_env("search_r1", "a800x16", "qwen3-14b", seed=1, batch_prompts=2, group_size=2)
    assert S.sweep_cache_path(env1) != files[0]
    with pytest.raises(AssertionError, match="measured again"):
        S.static_sweep(env1, jobs=1)


@pytest.mark.parametrize("n_groups", [3, 400])
def test_recorded_replay_gives_the_same_measurement(n_groups):
    """The sweep draws the replay's groups once for all candidates; a candidate measured on the recording
    (all of it, or past its end, where it continues live) is the candidate measured on its own."""
    import copy

    env = make_env("r2e_gym", "a800x16", "qwen3-14b", seed=2, batch_prompts=2, group_size=2)
    rec = S.RecordedReplay(S.StationaryReplay(copy.deepcopy(env.workload)), env.seed + S.SWEEP_SEED_OFFSET, n_groups)
    alone = S.measure_candidate(env, 8, 2)
    assert S.measure_candidate(env, 8, 2, rec) == alone
    assert S.measure_candidate(env, 8, 2, rec) == alone  # a second reader starts from the beginning again
    with pytest.raises(S.SimError, match="another seed"):
        rec.fresh().sample_group(0, random.Random(0))


def test_the_libra_loop_sweep_is_its_own_cache_entry_and_ranked_by_libra(tmp_path, monkeypatch):
    """static_libra_loop measures the same candidates under Libra's loop (a cache entry of its own, never AReaL's
    read back), runs the best of them under that loop, and Libra's controller holds its ranking against both."""
    from areal_libra.sim.libra import libra_run_config, static_libra_loop
    from areal_libra.sim.registry import run_system

    monkeypatch.setenv("AREAL_LIBRA_CACHE", str(tmp_path))
    monkeypatch.setenv("AREAL_LIBRA_SWEEP_JOBS", "1")  # in this process, where the recording wrapper is
    env = make_env("search_r1", "a800x16", "qwen3-14b", seed=0, batch_prompts=2, group_size=2)
    full = S.sweep_candidates(env)
    some = [full[0], full[-1]]
    monkeypatch.setattr(S, "sweep_candidates", lambda e: some)
    areal = S.static_sweep(env, jobs=1)
    run = libra_run_config(env)
    assert run != S.areal_run_config(env) and run.working_set_admission
    assert S.sweep_cache_path(env, S.sweep_key(env, run)) != S.sweep_cache_path(env)
    measured = []
    real = S.measure_candidate
    monkeypatch.setattr(S, "measure_candidate", lambda *a, **k: measured.append(a[-1]) or real(*a, **k))
    spec = static_libra_loop(env)
    assert measured == [run, run]  # measured under Libra's loop, not read from AReaL's entry
    loop = spec.extra["loop_candidates"]
    assert [(c["rollout_gpus"], c["tp"]) for c in loop] == [(c["rollout_gpus"], c["tp"]) for c in areal]
    assert spec.run == run and spec.layout.rollout_gpus == max(loop, key=lambda c: c["tokens_per_s"])["rollout_gpus"]
    assert len(list((tmp_path / "static_sweep").glob("*.json"))) == 2
    res, _ = run_system("libra", env, 8)
    for key, cands in (("ranking", areal), ("ranking_own_loop", loop)):
        rk = res[key]
        assert rk["n_candidates"] == 2 and rk["steps"] == [5, 6, 7]
        best = max(cands, key=lambda c: c["tokens_per_s"])
        assert rk["measured_best"] == f"{best['rollout_gpus']}xTP{best['tp']} train {best['train']['gpus']}"
