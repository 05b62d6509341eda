"""What the simulated Libra plans on: the re-plan history is whole complete cohorts (control.cohorts.CohortHistory through sim.libra.SimCohorts),
and the profiling pass times training on the run's own batch (sim.calib, train_lens)."""

from dataclasses import replace

import areal_libra.sim.libra as L
from areal_libra.cost.training import TrainCost, TrainParallel
from areal_libra.sim.calib import calibrated_hardware
from areal_libra.sim.registry import build_system, run_system
from areal_libra.sim.report import make_env


def test_replan_history_is_whole_complete_cohorts():
    env = make_env("dapo_math", "a800x48", "qwen3-14b", seed=0)
    spec = build_system("libra", env)
    _, sim = run_system("libra", env, 3, spec)
    running = [g.version for g in sim.pending if not g.ready]
    assert running, "the run should still have groups decoding"
    open_v = min(running)
    finished = list(sim.finished_trajs)
    assert len(finished) == len(sim.traj_durations)  # all of them still in the deque at this size
    want = sorted((t.prompt_tokens, t.final_length) for t in finished if t.step < open_v)
    later = [t for t in finished if t.step >= open_v]
    assert later, "finished trajectories of a cohort still running exist and must be left out"
    cohorts = spec.controller.cluster.cohorts
    got = cohorts.history(sim, 10**6)
    assert sorted(got) == want
    # The last to finish are completion-ordered; the complete cohorts are not: their mean is not theirs.
    sub = cohorts.history(sim, 50)
    assert len(sub) == min(50, len(want)) and set(sub) <= set(want)


def test_training_profiled_on_the_run_batch_prices_it():
    env = make_env("dapo_math", "a800x48", "qwen3-14b", seed=0, batch_prompts=128, group_size=16)
    lens = L.train_profile_lens(env, env.workload.profile(16))
    assert lens is not None and len(lens) == 128 * 16
    hw0, err0 = calibrated_hardware(env.truth, env.cluster.hardware, env.model, 0)
    hw1, err1 = calibrated_hardware(env.truth, env.cluster.hardware, env.model, 0, train_lens=lens)
    assert "train" not in err0 and err1["train"] < 0.1
    for par in (TrainParallel(2, 1, 12), TrainParallel(1, 4, 6)):
        truth = env.truth.train_step_s(lens, par.tp, par.pp, par.dp, -(-len(lens) // par.dp))
        e0, e1 = (abs(TrainCost(replace(env.cluster, hardware=hw), env.model).step_time_s(par, lens) / truth - 1)
                  for hw in (hw0, hw1))
        assert e1 < e0 and e1 < 0.08, (par, e0, e1)


def test_the_run_length_reaches_the_gate():
    # The simulator counts steps from 0: a 3-step run's last observation is step 2, after which nothing is credited.
    env = make_env("dapo_math", "a800x48", "qwen3-14b", seed=0)
    spec = build_system("libra", env)
    assert spec.controller.ctl.cfg.last_step is None
    run_system("libra", env, 3, spec)
    assert spec.controller.ctl.cfg.last_step == 2 and spec.controller.ctl._horizon(2) == 0
