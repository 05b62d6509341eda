"""On an emulated cluster the live controller counts emulated seconds, as the planner, the gate's
reconfiguration cost and the simulator do: a step's real times divided by the run's time scale."""

from __future__ import annotations

from pathlib import Path

from areal_libra.control import StepObservation
from areal_libra.live.live_cluster import emulated_time
from areal_libra.rollout.emulation import ClusterEmulation
from tests.live.test_control_failures import RefusingFleet, _control
from tests.live.test_recover_state import _plan, _rec


def test_an_observation_in_emulated_seconds() -> None:
    obs = StepObservation(3, interval_s=10.0, train_s=6.0, rollout_s=8.0, queue_pressure=0.5, active_pressure=0.9,
                          wait_s=2.0, tokens=100.0, rollout_busy=0.7)
    e = emulated_time(obs, 0.25)
    assert (e.interval_s, e.train_s, e.rollout_s, e.wait_s) == (40.0, 24.0, 32.0, 8.0)
    # Shares and counts have no unit of time.
    assert (e.step, e.queue_pressure, e.active_pressure, e.tokens, e.rollout_busy) == (3, 0.5, 0.9, 100.0, 0.7)


def test_the_controller_of_an_emulated_run_reads_emulated_seconds(tmp_path: Path) -> None:
    seen = {}
    for scale in (1.0, 0.25):
        (tmp_path / str(scale)).mkdir()
        control = _control(tmp_path / str(scale), RefusingFleet(), [_plan()])  # the plan is the launch layout
        control.cluster.emulation = ClusterEmulation(accelerators=4, time_scale=scale)
        control.on_step(1, _rec(1))  # the first plan
        out = control.on_step(2, _rec(2))  # 12 s of wall, 4 s of it training
        seen[scale] = (out["plan/obs_train_s"], control.ctl.intervals[-1])
    assert seen[1.0] == (4.0, 12.0)
    assert seen[0.25] == (16.0, 48.0)


def test_a_runs_controller_knows_its_last_step() -> None:
    # A live run counts steps from 1: with total_train_steps=30 the last decision comes at step 30, with no step
    # left to credit a plan with (the simulator's 30-step run ends at its step 29).
    from omegaconf import OmegaConf

    from areal_libra.config import compose
    from areal_libra.live.live_cluster import run_control_config

    c = compose(["cluster=emulated", "total_train_steps=30", "rollout.max_head_offpolicyness=2"])
    cfg = run_control_config(OmegaConf.to_object(c.libra).control, OmegaConf.to_object(c.areal))
    assert cfg.last_step == 30 and cfg.staleness == 2


def test_a_runs_history_covers_its_batches_in_flight() -> None:
    # eta + 1 batches of batch_size prompts x n_samples each: the planner, the gate and a restart's saved history
    # read that many finished trajectories, not one cohort.
    from omegaconf import OmegaConf

    from areal_libra.config import compose
    from areal_libra.live.live_cluster import run_control_config

    c = compose(["cluster=emulated", "rollout.max_head_offpolicyness=4", "train_dataset.batch_size=128",
                 "gconfig.n_samples=16"])
    cfg = run_control_config(OmegaConf.to_object(c.libra).control, OmegaConf.to_object(c.areal))
    assert cfg.history == 5 * 128 * 16
