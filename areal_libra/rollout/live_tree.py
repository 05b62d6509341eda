"""The live prefix tree: finished trajectories reach the routing policy, the tree is rebuilt and saved
off the request path, and reloaded when a run recovers.

Visibility follows the replay rule (scheduler/replay.py): trajectories that finish during a training
step are buffered and reach the policy at the step boundary (`end_step`), unless `online_siblings` lets
them in at once. Every `rebuild_every_steps` steps a background thread rebuilds a fresh tree from the last
`window` learned trajectories, saves it (atomic) with that window in the run directory, and swaps it in
under the dispatcher's lock, first replaying whatever was learned while it was being built.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from pathlib import Path

from areal_libra.cmlfq import Dispatcher, PrefixTree
from areal_libra.trace import TraceError, Trajectory, read_traces, write_traces

log = logging.getLogger(__name__)

TREE_FILE = "cmlfq_tree.bin"
WINDOW_FILE = "cmlfq_window.jsonl"


def _like(old: PrefixTree, tree: PrefixTree | None = None) -> PrefixTree:
    """An empty tree (or `tree`) with the parameters and state coarsening of `old`."""
    out = (
        tree
        if tree is not None
        else PrefixTree(
            min_samples=old.min_samples,
            window=old.window,
            max_nodes=old.max_nodes,
            sizes=old.sizes,
            backend=old.backend,
        )
    )
    out.state_map = getattr(old, "state_map", None)  # the policy's state_key switch
    return out


class LiveTree:
    def __init__(
        self,
        dispatcher: Dispatcher,
        run_dir: str | Path | None,
        rebuild_every_steps: int = 1,
        window: int = 5000,
        online: bool = False,
        save: bool = True,
    ) -> None:
        self.dispatcher = dispatcher
        self.policy = dispatcher.policy
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.rebuild_every_steps = max(0, int(rebuild_every_steps))
        self.online = online
        self.save_enabled = save and self.run_dir is not None
        self._lock = threading.Lock()
        self._pending: list[Trajectory] = []
        self._learned: deque[tuple[int, Trajectory]] = deque(maxlen=max(1, int(window)))
        self._seq = 0
        self._steps = 0
        self._worker: threading.Thread | None = None
        self.rebuilds = 0
        self.saves = 0
        self.last_error: str | None = None

    @property
    def tree(self) -> PrefixTree | None:
        return getattr(self.policy, "tree", None)

    # --- recovery ---
    def restore(self, run_dir: str | Path) -> bool:
        """Load the saved tree and window (if any); True when a tree was loaded."""
        d = Path(run_dir)
        tree = self.tree
        if tree is None or not (d / TREE_FILE).exists():
            return False
        loaded = PrefixTree.load_or_empty(
            d / TREE_FILE,
            min_samples=tree.min_samples,
            window=tree.window,
            max_nodes=tree.max_nodes,
            sizes=tree.sizes,
            backend=tree.backend,
        )
        try:
            window = read_traces(d / WINDOW_FILE) if (d / WINDOW_FILE).exists() else []
        except TraceError as e:
            log.warning("live tree: %s; the rebuild window starts empty", e)
            window = []
        with self.dispatcher.lock:
            self.policy.tree = _like(tree, loaded)
        with self._lock:
            for t in window:
                self._seq += 1
                self._learned.append((self._seq, t))
        return True

    # --- learning ---
    def add(self, traj: Trajectory) -> None:
        """A trajectory finished (the workflow's trajectory sink)."""
        if self.online:
            self._learn([traj])
        else:
            with self._lock:
                self._pending.append(traj)

    def _learn(self, trajs: list[Trajectory]) -> None:
        with self.dispatcher.lock:
            for t in trajs:
                self.dispatcher.finish(t)
            self.dispatcher.end_step()
            with self._lock:
                for t in trajs:
                    self._seq += 1
                    self._learned.append((self._seq, t))

    def end_step(self) -> None:
        """Training-step boundary: the step's trajectories become visible; maybe rebuild in background."""
        with self._lock:
            batch, self._pending = self._pending, []
            self._steps += 1
            due = self.rebuild_every_steps and self._steps % self.rebuild_every_steps == 0
        self._learn(batch)
        if due and self.tree is not None and (self._worker is None or not self._worker.is_alive()):
            self._worker = threading.Thread(target=self._rebuild, name="cmlfq-rebuild", daemon=True)
            self._worker.start()

    def _rebuild(self) -> None:
        try:
            old = self.tree
            with self._lock:
                snap = list(self._learned)
            cut = snap[-1][0] if snap else 0
            fresh = _like(old)
            window = [t for _, t in snap]
            fresh.rebuild(window)
            if self.save_enabled:
                fresh.save(self.run_dir / TREE_FILE)
                write_traces(self.run_dir / WINDOW_FILE, window)
                self.saves += 1
            with self.dispatcher.lock:
                with self._lock:
                    late = [t for s, t in self._learned if s > cut]
                # The policy may have rebuilt its own tree meanwhile (auto mode changed the tree's shape),
                # or keeps drift-scaled samples (it rebuilds itself at each step): then its tree stays.
                if self.policy.tree is not old or getattr(self.policy, "drift", None) is not None:
                    return
                for t in late:
                    fresh.insert(t)
                self.policy.tree = fresh
            self.rebuilds += 1
        except Exception as e:  # noqa: BLE001 - a failed rebuild keeps the old tree; routing goes on
            self.last_error = f"{type(e).__name__}: {e}"
            log.warning("live tree rebuild failed (%s); keeping the current tree", self.last_error)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for a running rebuild and the policy's background auto choice (tests, shutdown)."""
        w = self._worker
        if w is not None:
            w.join(timeout)
        wait_auto = getattr(self.policy, "wait_auto", None)
        if wait_auto is not None:
            with self.dispatcher.lock:
                wait_auto(timeout)

    def metrics(self) -> dict:
        tree = self.tree
        return {
            "cmlfq/tree_nodes": tree.node_count() if tree is not None else 0,
            "cmlfq/tree_rebuilds": self.rebuilds,
            "cmlfq/tree_window": len(self._learned),
        }
