"""The live profiling pass's training step (live_cluster.fit_profiled_training): the planner's training
efficiency fitted to one training step of the run's batch on the emulated hardware, as the simulator's Libra
fits it (sim.libra.PROFILE_TRAIN): the same batch from the pass's trajectories in whatever order they finished,
and the same calibrated spec."""

from __future__ import annotations

import random
from dataclasses import replace

from areal_libra.config import EmulatedConfig
from areal_libra.control.profile import ProfilePass
from areal_libra.cost.presets import ClusterSpec, load_hardware, load_model
from areal_libra.cost.training import TrainCost, TrainParallel
from areal_libra.live.live_cluster import LivePlanSource, fit_profiled_training
from areal_libra.rollout.emulation import profiled_hardware
from areal_libra.sim import libra as sim_libra
from areal_libra.sim.report import make_env


def test_live_pass_fits_training_as_the_simulator():
    env = make_env("search_r1", "h200x64", "qwen3-14b", 0, 64, 16)
    trajs = list(env.workload.profile(sim_libra.profile_groups(env)))
    # the simulator's planner spec: the profile's batch timed and fitted (libra_system sets the lengths first)
    env._train_profile_lens = sim_libra.train_profile_lens(env, trajs)
    sim_hw = sim_libra.planner_cluster(env).hardware

    emulated = EmulatedConfig(model="qwen3-14b", gpu="h200", seed=0)
    before = profiled_hardware("qwen3-14b", "h200", 0)
    src = LivePlanSource(ClusterSpec(before, nodes=1, gpus_per_node=64), load_model("qwen3-14b"), None)
    finished = list(trajs)
    random.Random(1).shuffle(finished)  # the live pass hands them over in completion order
    assert fit_profiled_training(src, emulated, ProfilePass(16, 16).extend(finished), 64 * 16)
    assert src.cluster.hardware == sim_hw and src.cluster.hardware != before
    # the fit prices the run's batch closer to what the emulated trainer is paced to
    lens = env._train_profile_lens
    par = TrainParallel(1, 1, 40)
    truth = env.truth.train_step_s(lens, par.tp, par.pp, par.dp, -(-len(lens) // par.dp))
    errs = [abs(TrainCost(replace(src.cluster, hardware=hw), load_model("qwen3-14b")).step_time_s(par, lens)
                / truth - 1) for hw in (before, src.cluster.hardware)]
    assert errs[1] < errs[0], errs
    assert not fit_profiled_training(src, emulated, ProfilePass(16, 16), 64 * 16)  # nothing finished: kept


def test_preset_hardware_is_the_planners_base():
    # the live fit starts from the same preset the simulator's env plans on
    env = make_env("search_r1", "h200x64", "qwen3-14b", 0, 64, 16)
    assert env.cluster.hardware == load_hardware("h200")


def test_live_plan_source_calibrates_as_the_simulators():
    """LivePlanSource is a CalibratedPlanSource: on the simulator's spec and planner settings its price terms
    and calibrated plans are the simulator's (one planner, two adapters), so the live controller calibrates
    online as the simulated one does."""
    from areal_libra.control import ControlConfig, LibraController
    from areal_libra.control.calibration import Factors

    env = make_env("search_r1", "h200x64", "qwen3-14b", 0, 64, 16)
    trajs = list(env.workload.profile(sim_libra.profile_groups(env)))
    env._train_profile_lens = sim_libra.train_profile_lens(env, trajs)
    sim_src = sim_libra.SimPlanSource(env, False)
    live = LivePlanSource(sim_libra.planner_cluster(env), env.model or env.truth.model.name,
                          sim_libra.planner_config(env))
    hist = [(t.prompt_tokens, t.final_length) for t in trajs]
    plan = sim_src.solve(hist)
    assert live.price_terms(plan, hist) == sim_src.price_terms(plan, hist)
    f = Factors(train=1.3, rollout=0.5)
    a, b = live.solve_calibrated(hist, f), sim_src.solve_calibrated(hist, f)
    assert (a.rollout_alloc(), a.train_alloc()) == (b.rollout_alloc(), b.train_alloc())
    assert (a.rollout_alloc(), a.train_alloc()) != (plan.rollout_alloc(), plan.train_alloc())  # the factors count
    assert LibraController(ControlConfig(), live, plan).calib is not None
