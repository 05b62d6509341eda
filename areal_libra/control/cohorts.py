"""The re-plan history on complete cohorts, written once for the simulator and the live run.

A cohort is the finished trajectories of one policy version: the groups that started at that version. It is
complete when none of its groups, and none of an older version's, is still running (every group started
before the oldest running one has finished, its whole tail included). The controller re-plans on the newest
complete cohorts, not on the last n trajectories to finish: those are completion-ordered, so early in a step
they are the batch's short trajectories while the long ones of the same version still decode, and a plan
solved on them moves GPUs from a starved rollout side to training (docs/simulator.md, issue 23). With no
complete cohort yet the history is empty (the controller then does not re-plan).

The cluster adapters feed it: `add(version, row)` for every finished trajectory (the version its group
started at), and `history(n, oldest_running)` with the oldest start version among the groups still running
(None: none is running, every cohort is complete). The simulator reads the oldest running version from its
pending groups (sim.libra.SimCluster), the live run from the episodes its workflow has in flight
(workflows.sink.running / oldest_running).
"""

from __future__ import annotations


class CohortHistory:
    """Finished trajectories' rows by the policy version their group started at, and the history of the
    newest complete cohorts."""

    def __init__(self) -> None:
        self.by_version: dict[int, list[tuple[int, ...]]] = {}

    def add(self, version: int, row: tuple[int, ...]) -> None:
        """One finished trajectory whose group started at `version` (rows of a version in completion order)."""
        self.by_version.setdefault(int(version), []).append(row)

    def __len__(self) -> int:
        return sum(len(r) for r in self.by_version.values())

    def history(self, n: int, oldest_running: int | None) -> list[tuple[int, ...]]:
        """At most `n` rows of the newest complete cohorts (versions below `oldest_running`; all of them when
        it is None): whole cohorts, newest first, until n rows are reached, then an even subsample."""
        rows: list[tuple[int, ...]] = []
        for v in sorted((v for v in self.by_version if oldest_running is None or v < oldest_running), reverse=True):
            rows = self.by_version[v] + rows
            if len(rows) >= n:
                break
        if len(rows) > n:  # an even subsample of whole cohorts (rows are completion-ordered within one)
            rows = [rows[i * len(rows) // n] for i in range(n)]
        return rows

    def needed(self, n: int, oldest_running: int | None) -> dict[int, list[tuple[int, ...]]]:
        """The cohorts a later `history(n, ...)` can still read (the oldest running version only grows): every
        cohort still running, and the newest complete ones up to n rows (what a restart keeps, live.recover)."""
        out: dict[int, list[tuple[int, ...]]] = {}
        rows = 0
        for v in sorted(self.by_version, reverse=True):
            if oldest_running is not None and v >= oldest_running:
                out[v] = list(self.by_version[v])
            elif rows < n:
                out[v] = list(self.by_version[v])
                rows += len(out[v])
        return out
