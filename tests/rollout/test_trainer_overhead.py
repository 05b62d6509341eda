"""The emulated trainer's own real work (taking the batch, writing weights, metrics, the controller) is absorbed
by the paced window, so a step takes the emulated hardware's time; what does not fit is an overrun."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from areal_libra.control import StepObservation
from areal_libra.live.live_cluster import observation
from areal_libra.rollout.trainer_overhead import TrainerOverhead, paced_sleep


def test_a_batch_waited_for_is_the_trainers_own_only_after_its_last_wait() -> None:
    ledger = TrainerOverhead(wait_floor_s=0.05)
    # 6 s in prepare_batch: 1 s of submits, 4.5 s waiting for results, 0.5 s taking the batch after.
    assert ledger.batch(6.0, waited_s=4.5, after_wait_s=0.5) == (0.5, 5.5)
    # Rollout ahead: the results were there at once, all of prepare_batch is the trainer's own.
    assert ledger.batch(2.0, waited_s=0.01, after_wait_s=0.3) == (2.0, 0.0)


def test_the_work_after_a_window_less_the_truths_sync_is_carried_into_the_next() -> None:
    ledger = TrainerOverhead()
    ledger.after_window(post_s=1.6, sync_s=0.3)
    assert ledger.take(0.5) == pytest.approx(1.8)
    assert ledger.take(0.5) == 0.5  # taken once
    ledger.after_window(post_s=0.2, sync_s=0.3)  # shorter than the sync the host paced: nothing to absorb
    assert ledger.carry_s == 0.0


def test_the_window_absorbs_what_fits_and_reports_the_rest_as_overrun() -> None:
    assert paced_sleep(10.0, compute_s=3.0, debt_s=2.0) == (5.0, 0.0)
    assert paced_sleep(10.0, compute_s=3.0, debt_s=9.0) == (0.0, 2.0)


class _Metrics:
    def __init__(self) -> None:
        self.sources: list = []
        self.hooks: list = []

    def add_source(self, fn) -> None:
        self.sources.append(fn)

    def add_step_hook(self, fn) -> None:
        self.hooks.append(fn)


def test_the_paced_trainer_takes_the_truths_time_with_its_own_work_around_the_update() -> None:
    """Two steps of a trainer whose prepare_batch submits (0.15 s) and then waits (0.3 s) for its batch, and
    whose work after the update (0.2 s beyond the truth's weight sync) stands for the weight write and metrics: the second step's window
    shortens by that work, the interval outside the wait stays the target, the wait is reported apart."""
    from areal_libra.rollout.emulation import ClusterEmulation, configure, install_train_pacing
    from areal_libra.rollout.groups import RolloutGroup

    class Dispatcher:
        def wait_results(self, count, timeout=None):
            time.sleep(0.3)
            return [None] * count

    dispatcher = Dispatcher()

    class Actor:
        def prepare_batch(self, *a, **k):
            time.sleep(0.15)  # the submits: they overlap rollout's work, so not the trainer's own
            dispatcher.wait_results(2)
            return [{"emul_tokens": torch.tensor([4000])} for _ in range(8)]

        def ppo_update(self, batch):
            return None

    emu = ClusterEmulation(accelerators=16, time_scale=1e-3)
    lens = [4000] * 8
    # A time scale that makes the target about 1 s on 12 trainer accelerators.
    emu = ClusterEmulation(accelerators=16, time_scale=1.0 / emu.train_target_s(lens, 12) * 1e-3)
    target = emu.train_target_s(lens, 12)
    assert target == pytest.approx(1.0)
    trainer = SimpleNamespace(actor=Actor())
    m = _Metrics()
    install_train_pacing(trainer, emu, lambda: [RolloutGroup("g", 1, 4)], m,
                         dispatcher=dispatcher)
    sync = emu.weight_sync_target_s(4)
    try:
        marks = []
        for _ in range(2):
            t0 = time.perf_counter()
            batch = trainer.actor.prepare_batch()
            t1 = time.perf_counter()
            trainer.actor.ppo_update(batch)
            time.sleep(sync + 0.2)  # after the window: the host's paced sync, then weight write, metrics, ...
            marks.append((t0, t1, time.perf_counter(), m.sources[0]()))
    finally:
        configure(None)
    first, second = marks[0][3], marks[1][3]
    assert first["emul/train_overhead_s"] < 0.05  # nothing carried yet; the batch was waited for
    assert second["emul/train_overhead_s"] == pytest.approx(0.2, abs=0.05)
    assert second["emul/wait_s"] == pytest.approx(0.45, abs=0.08)  # the submits and the wait
    assert second["emul/train_s"] == pytest.approx(target)
    assert second["emul/train_pacing_error"] == 0.0
    assert second["emul/batch_tokens"] == 8 * 4000
    # The second step's window (batch in hand -> the work after the update done) is the target, not target + 0.2.
    t0, t1, t2, _ = marks[1]
    assert t2 - t1 == pytest.approx(target + sync, abs=0.1)


def test_the_controller_reads_the_emulated_account_of_a_step() -> None:
    rec = {"step_time_s": 30.0, "timeperf/rollout": 6.0, "timeperf/train_step": 17.0, "timeperf/update_weights": 3.0,
           "emul/train_s": 22.0, "emul/wait_s": 5.0, "emul/batch_tokens": 9000.0}
    obs = observation(4, rec)
    assert (obs.train_s, obs.wait_s, obs.tokens) == (22.0, 5.0, 9000.0)
    measured = StepObservation(step=4, interval_s=30.0, train_s=17.0, rollout_s=23.0)
    obs = observation(4, rec, measured=measured, inputs={"wait_s": 6.0, "backlog": 0, "batch": 64})
    assert (obs.train_s, obs.wait_s, obs.rollout_s) == (22.0, 5.0, 27.0)
    # A live run that is not emulated: the wait is the trainer's for its batch, none when groups were left over.
    plain = {"step_time_s": 30.0, "timeperf/rollout": 6.0, "timeperf/train_step": 20.0}
    assert observation(4, plain).wait_s == 6.0
    assert observation(4, plain, measured=measured,
                       inputs={"wait_s": 6.0, "backlog": 40, "batch": 64}).wait_s == 0.0


def test_an_emulated_rollout_takes_new_groups_once_the_new_version_is_set() -> None:
    """AReaL's step: pause submissions, update the weights, set the version, save, commit the stats (the
    controller), resume. Emulated, submissions resume at the version: the rest is this machine's work."""
    from areal_libra.rollout.emulation import resume_after_update

    calls: list[str] = []

    class Rollout:
        def pause(self):
            calls.append("pause")

        def resume(self):
            calls.append("resume")

        def set_version(self, v):
            calls.append(f"version {v}")

    r = Rollout()
    resume_after_update(r)
    r.set_version(0)  # the start: nothing paused, nothing resumed
    r.pause()
    r.set_version(1)
    calls.append("stats")
    r.resume()
    assert calls == ["version 0", "pause", "version 1", "resume", "stats", "resume"]
