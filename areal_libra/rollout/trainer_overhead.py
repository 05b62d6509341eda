"""The emulated trainer's own per-step work, which the emulated hardware does not have.

On an emulated cluster the trainer's update is paced to the truth's training time, but AReaL's loop around it
also costs this machine real seconds every step: submitting the next groups and taking the batch
(`prepare_batch`), writing the weights for the servers (update_weights beyond the truth's sync, which the
emulated host paces itself), the metrics and the controller. At time scale 0.125 that was about 3 real seconds
a step, 24 emulated ones (R2E-Gym: the controller's fixed term read 22.9 s live against the simulator's 2.1 s,
and the live ratio fell 12.6% from the simulator's). The ledger counts that work and the next paced window
absorbs it, so a step takes the truth's time whenever the trainer's real work fits in it; what does not fit is
an overrun (emul/pacing_error), never hidden.

A pure core: the caller passes the times it measured.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainerOverhead:
    """`wait_floor_s`: a `prepare_batch` that waited for results longer than this waited for rollout (the
    submits before it overlapped rollout's work); `carry_s`: the last step's work after its paced window (the
    weight update beyond the truth's sync, metrics, the controller), absorbed by the next window."""

    wait_floor_s: float = 0.05
    carry_s: float = 0.0

    def batch(self, batch_s: float, waited_s: float, after_wait_s: float) -> tuple[float, float]:
        """(the trainer's own share of one prepare_batch, its wait for rollout). `waited_s`: time inside the
        dispatcher's waits for results; `after_wait_s`: from the last of them to the batch in hand. A batch that
        had to be waited for: only the work after the last wait is the trainer's own (the batch was not ready
        sooner); a batch in hand at once (rollout ahead): all of it."""
        batch_s = max(0.0, batch_s)
        own = min(batch_s, max(0.0, after_wait_s)) if waited_s > self.wait_floor_s else batch_s
        return own, batch_s - own

    def take(self, own_s: float) -> float:
        """The overhead this step's paced window absorbs: its batch's own share and the carried work."""
        debt, self.carry_s = max(0.0, own_s) + self.carry_s, 0.0
        return debt

    def after_window(self, post_s: float, sync_s: float) -> None:
        """The work between a paced window's end and the next prepare_batch, less the truth's weight sync (the
        host paces that: it is the emulated hardware's time, not overhead)."""
        self.carry_s = max(0.0, post_s - max(0.0, sync_s))


def paced_sleep(target_s: float, compute_s: float, debt_s: float) -> tuple[float, float]:
    """(sleep, overrun) of a paced window: the window's own compute and the absorbed overhead against the
    truth's target."""
    spent = max(0.0, compute_s) + max(0.0, debt_s)
    return max(0.0, target_s - spent), max(0.0, spent - target_s)
