"""Connecting to Ray, and a real multi-node Ray cluster on this host (cluster=ray_local).

Two ways of meeting Ray, kept apart on purpose:

- a private instance (tests, the rollout-groups helper): `init_private(...)` passes address="local", so a
  cluster started earlier with `ray start` on this machine, or the stale `ray_current_cluster` file a killed
  one leaves in Ray's temp folder, is never joined (ray.init with no address would join it and refuse
  num_cpus/num_gpus: "When connecting to an existing cluster, num_cpus and num_gpus must not be provided");
- a cluster of several raylets (`LocalRayCluster`): `ray start --head` plus `ray start --address ...`, each
  node with its own CPUs and accelerators. Accelerators are the custom resource "accel" on CPU nodes (GPU
  nodes can declare it too), so the placement code is the same here and on GPU nodes. Every process it
  starts runs in its own session under a private temp folder; `stop()` ends them by PID (never `ray stop`,
  which ends every Ray instance of the machine).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_libra.utils import free_port, pid_alive

ACCEL = "accel"  # the custom Ray resource that stands for one accelerator


class RayClusterError(RuntimeError):
    """A Ray cluster problem the user can fix; one line."""


def init_private(**kwargs: Any) -> None:
    """A private, in-process Ray instance of this driver (never an existing cluster: address="local")."""
    import ray

    opts: dict[str, Any] = dict(include_dashboard=False, log_to_driver=False, configure_logging=False)
    opts.update(kwargs)
    ray.init(address="local", **opts)


def ray_bin() -> str:
    """The `ray` script of this interpreter's environment."""
    return str(Path(sys.executable).with_name("ray"))


@dataclass
class RayNodeProc:
    """One `ray start --block` of a LocalRayCluster: the process whose session holds the node's daemons."""

    index: int
    proc: subprocess.Popen
    log_path: str
    node_id: str = ""

    @property
    def pid(self) -> int:
        return self.proc.pid


@dataclass
class LocalRayCluster:
    """`nodes` Ray nodes on this host, each with `cpus` CPUs and `accel` accelerators (custom resource)."""

    nodes: int = 2
    cpus: int = 1
    accel: int = 4
    log_dir: str = ""
    start_timeout_s: float = 120.0
    node_env: dict[int, dict[str, str]] = field(default_factory=dict)  # per-node extra environment (tests)
    procs: list[RayNodeProc] = field(default_factory=list)
    port: int = 0
    temp_dir: str = ""

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """The environment of every Ray process of this cluster (and of a driver that joins it)."""
        env = dict(os.environ)
        env.update(RAY_TMPDIR=self.temp_dir, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
        env.pop("RAY_ADDRESS", None)
        return env

    def _start_node(self, index: int) -> RayNodeProc:
        resources = json.dumps({ACCEL: self.accel})
        cmd = [ray_bin(), "start", "--block", "--num-cpus", str(self.cpus), "--num-gpus", "0",
               "--resources", resources, "--disable-usage-stats", "--object-store-memory", str(100 * 2**20)]
        if index == 0:
            cmd += ["--head", "--port", str(self.port), "--include-dashboard=false"]
        else:
            cmd += ["--address", self.address]
        log_path = os.path.join(self.log_dir, f"ray_node{index}.log")
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=self.env() | self.node_env.get(index, {}), start_new_session=True)
        node = RayNodeProc(index, proc, log_path)
        self.procs.append(node)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            text = Path(log_path).read_text(errors="replace")
            if "Ray runtime started" in text:
                return node
            if proc.poll() is not None:
                break
            time.sleep(0.5)
        tail = Path(log_path).read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
        raise RayClusterError(f"Ray node {index} did not start in {self.start_timeout_s:.0f}s: {tail[0]}")

    def start(self) -> LocalRayCluster:
        """Start the head, then the workers; stop what started if one fails."""
        if self.nodes < 1 or self.cpus < 1 or self.accel < 0:
            raise RayClusterError(f"libra.ray.local: nodes and cpus must be >= 1 and accel >= 0, got "
                                  f"nodes={self.nodes} cpus={self.cpus} accel={self.accel}")
        self.log_dir = self.log_dir or tempfile.mkdtemp(prefix="ray-logs-")
        os.makedirs(self.log_dir, exist_ok=True)
        # A short private temp folder (Ray's unix socket paths must stay under ~107 characters); it also
        # keeps this cluster's ray_current_cluster file away from the machine's /tmp/ray.
        self.temp_dir = tempfile.mkdtemp(prefix="arl-ray-", dir="/tmp")
        self.port = free_port()
        try:
            for i in range(self.nodes):
                self._start_node(i)
        except BaseException:
            self.stop()
            raise
        return self

    def session_pids(self, index: int | None = None) -> list[int]:
        """PIDs of this cluster's processes (or node `index`'s): the `ray start` sessions and every process
        whose command line names the private temp folder (raylets, workers, agents)."""
        sids = {p.pid for p in self.procs if index is None or p.index == index}
        out = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            pid = int(d.name)
            try:
                sid = os.getsid(pid)
                cmd = (d / "cmdline").read_bytes()
            except OSError:
                continue
            if sid in sids or (index is None and self.temp_dir and self.temp_dir.encode() in cmd):
                out.append(pid)
        return out

    def raylet_pid(self, index: int) -> int | None:
        """The raylet of node `index` (killing it is how a node is lost)."""
        for pid in self.session_pids(index):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if cmd and cmd[0].endswith(b"/raylet"):
                return pid
        return None

    def kill_node(self, index: int) -> int | None:
        """SIGKILL node `index`'s raylet; its pid (None: not found)."""
        pid = self.raylet_pid(index)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pid

    def stop(self, grace_s: float = 5.0) -> list[int]:
        """End every process of this cluster by PID (workers first, then the head); the PIDs signalled."""
        pids = self.session_pids()
        for node in reversed(self.procs):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(node.pid, signal.SIGTERM)
        _wait_gone(pids, grace_s)
        for pid in self.session_pids() + pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        for node in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(node.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.proc.wait(timeout=5)
        # SIGKILL is delivered asynchronously: wait until every signalled process is gone (a caller that checks
        # right after stop() saw one still alive in a clean-clone run).
        _wait_gone(pids, grace_s)
        self.procs.clear()
        if self.temp_dir:  # Ray's sockets and session logs of this cluster (the nodes' own logs are in log_dir)
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        return pids


def _wait_gone(pids: list[int], timeout_s: float) -> None:
    """Wait up to `timeout_s` for every pid to be gone."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.1)
