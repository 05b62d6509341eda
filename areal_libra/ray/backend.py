"""Rollout servers and trainer ranks as processes that Ray places (cluster=ray, cluster=ray_local).

Every process of a run on Ray is started by a small Ray actor, `ProcessHost`, which runs it with Popen on the
node Ray put the actor on, in its own session, and stops it by its process group. The actor is placed by a
placement group bundle of the accelerators the process needs ({"accel": t} for a TP-t server: STRICT_PACK, so
a TP group never spans nodes); killing the actor or losing its node ends the process (the embedded server
watches its parent, the actor).

`RayBackend` is the fleet's ServerBackend (rollout/backend.py) on Ray: `start` places one group per server,
preferring nodes that hold no trainer rank and then the node with the most free accelerators, and returns
once every server answers /health on its node's IP (never a hard-coded loopback); `stop` ends the process,
the actor and the placement group (a group left behind on a lost node would be re-placed by Ray on a live
node and hold its accelerators). Actors and groups are named under the run's namespace, so the trainer can
adopt the servers the launcher started (`adopt`) and the launcher can remove everything at the end
(`remove_run`).

Weights: a new or revived server loads the checkpoint of the last disk weight update from the run's
`cluster.fileroot`, which must be one folder every node sees (NFS or similar; on one host it is).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from areal_libra.ray.cluster import ACCEL
from areal_libra.rollout.launcher import (
    ServerLaunchError,
    ServerSpec,
    build_command,
    server_env_overlay,
    wait_healthy,
)
from areal_libra.utils import append_jsonl, free_port, read_jsonl

NAMESPACE_ENV = "AREAL_LIBRA_RAY_NAMESPACE"
ADDRESS_ENV = "AREAL_LIBRA_RAY_ADDRESS"
TRAINER_NODES_ENV = "AREAL_LIBRA_RAY_TRAINER_NODES"  # comma-separated node ids servers should avoid
RAY_SERVERS_FILE = "ray_servers.jsonl"  # every server a RayBackend started: node, actor, pid


@ray.remote(num_cpus=0, max_restarts=0)
class ProcessHost:
    """Runs one OS process on this actor's node; the process dies with the actor."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def node(self) -> dict:
        """Where this actor runs: Ray node id, node IP, its own PID, and whether the project imports."""
        import importlib.util

        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "actor_pid": os.getpid(), "project": importlib.util.find_spec("areal_libra") is not None}

    def free_port(self, host: str) -> int:
        return free_port(host)

    def start(self, cmd: list[str], env: dict[str, str], log_path: str) -> int:
        os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
        with open(log_path, "ab") as log:
            log.write(f"$ {' '.join(cmd)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, start_new_session=True)
        return self.proc.pid

    def start_server(self, kind: str, weights: str, spec: ServerSpec, log_dir: str, index: int,
                     weight_version: int | None) -> dict:
        """An embedded (or SGLang) rollout server on this node's IP; its address and PID."""
        ip = ray.util.get_node_ip_address()
        port = free_port(ip)
        if weight_version is not None and kind == "embedded":
            spec = replace(spec, extra_args=("--weight-version", str(weight_version), *spec.extra_args))
        # built here: --parent-pid is this actor, so the server ends with it (or with its node)
        cmd = build_command(kind, weights, spec, ip, port)
        log_path = os.path.join(log_dir, f"server{index}_{spec.group}_{port}.log")
        pid = self.start(cmd, {**os.environ, **server_env_overlay(kind, spec, None)}, log_path)
        return {"addr": f"{ip}:{port}", "pid": pid, "log_path": log_path,
                "node_id": ray.get_runtime_context().get_node_id()}

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM the process group, SIGKILL after `timeout`; the exit code."""
        if self.proc is None:
            return None
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # children left in the group
        return self.proc.poll()


def host_options(pg: PlacementGroup, bundle: int, accel: int, name: str, namespace: str) -> dict:
    """ProcessHost.options(...) for bundle `bundle` of `pg` holding `accel` accelerators."""
    return dict(name=name, namespace=namespace, num_cpus=0, resources={ACCEL: accel} if accel else {},
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle))


def free_accel_per_node() -> dict[str, float]:
    """Free accelerators of every live node (Ray's view)."""
    from ray._private import state

    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    return {nid: float(r.get(ACCEL, 0.0)) for nid, r in state.available_resources_per_node().items()
            if nid in alive}


def pick_node(tp: int, avoid: Sequence[str] = (), taken: dict[str, float] | None = None,
              exclude: Sequence[str] = ()) -> str | None:
    """The node a TP-`tp` server should go to: one with `tp` free accelerators, nodes in `avoid` (the
    trainer's) last, then the most free, never one in `exclude` (a node whose servers just died: Ray may not
    have marked it dead yet); None when no node has room (Ray then decides, and may refuse)."""
    free = free_accel_per_node()
    for nid, n in (taken or {}).items():
        free[nid] = free.get(nid, 0.0) - n
    fits = [nid for nid, n in free.items() if n >= tp and nid not in exclude]
    if not fits:
        return None
    return min(fits, key=lambda nid: (nid in avoid, -free[nid], nid))


def wait_ready(pgs: Sequence[PlacementGroup], timeout_s: float) -> bool:
    ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=timeout_s)
    return len(ready) == len(pgs)


@dataclass(eq=False)
class RayServer:
    """A rollout server started by RayBackend (the fleet's RunningServer)."""

    addr: str
    spec: ServerSpec
    log_path: str
    actor: Any
    pg: PlacementGroup | None
    node_id: str = ""
    server_pid: int | None = None
    name: str = ""
    gpu_ids: tuple[str, ...] = field(default_factory=tuple)

    @property
    def pid(self) -> int | None:
        return self.server_pid

    def alive(self, timeout: float = 5.0) -> bool:
        try:
            return ray.get(self.actor.poll.remote(), timeout=timeout) is None
        except Exception:  # noqa: BLE001 - actor or node gone (RayActorError), or no answer: dead
            return False

    def record(self) -> dict:
        return {"role": "rollout", "group": self.spec.group, "tp": self.spec.tp, "addr": self.addr,
                "node_id": self.node_id, "accel": self.spec.tp, "pid": self.server_pid, "actor": self.name,
                "pg": None if self.pg is None else self.pg.id.hex()}


@dataclass
class RayBackend:
    """The fleet's ServerBackend on Ray (see the module doc)."""

    kind: str = "embedded"  # the server program: embedded | sglang
    namespace: str = "areal_libra"
    avoid_nodes: tuple[str, ...] = ()  # node ids holding trainer ranks: servers go elsewhere first
    place_timeout_s: float = 120.0
    record_path: str | None = None  # every server started is appended here (placement.json reads it)
    started: list[RayServer] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.kind

    @property
    def places_devices(self) -> bool:
        return False  # Ray places them (placement groups), not the fleet's device pool

    @classmethod
    def from_env(cls, run_dir: str, kind: str = "embedded") -> RayBackend:
        """Inside a trainer the launcher started on Ray: connect and build the run's backend."""
        connect(os.environ[ADDRESS_ENV], os.environ[NAMESPACE_ENV])
        avoid = tuple(n for n in os.environ.get(TRAINER_NODES_ENV, "").split(",") if n)
        return cls(kind, os.environ[NAMESPACE_ENV], avoid, record_path=os.path.join(run_dir, RAY_SERVERS_FILE))

    def start(self, weights: str, specs: Sequence[ServerSpec], log_dir: str,
              devices: Sequence[tuple[str, ...]] | None = None, weight_version: int | None = None,
              timeout: float = 600.0) -> list[RayServer]:
        del devices  # Ray places the servers
        self.release_lost()
        suspect = {s.node_id for s in self.started if s.node_id and not s.alive(timeout=2.0)}
        made: list[RayServer] = []
        try:
            taken: dict[str, float] = {}
            pgs, targets = [], []
            for spec in specs:
                nid = pick_node(spec.tp, self.avoid_nodes, taken, tuple(suspect))
                if nid is not None:
                    taken[nid] = taken.get(nid, 0.0) + spec.tp
                name = f"{self.namespace}.srv-{uuid.uuid4().hex[:8]}"
                pg = placement_group([{ACCEL: float(spec.tp)}], strategy="STRICT_PACK", name=name,
                                     _soft_target_node_id=nid)
                pgs.append((name, pg))
                targets.append(nid)
            if not self._wait_placed([pg for _, pg in pgs]):
                for _, pg in pgs:
                    remove_placement_group(pg)
                need = ", ".join(f"TP{s.tp}" for s in specs)
                raise ServerLaunchError(f"Ray could not place {need} within {self.place_timeout_s:.0f}s "
                                        f"(free accel per node: {free_accel_per_node()})")
            infos = []
            for i, (spec, (name, pg)) in enumerate(zip(specs, pgs)):
                actor = ProcessHost.options(**host_options(pg, 0, spec.tp, name, self.namespace)).remote()
                made.append(RayServer("", spec, "", actor, pg, name=name))
                infos.append(actor.start_server.remote(self.kind, weights, spec, log_dir, len(self.started) + i,
                                                       weight_version))
            for s, info in zip(made, ray.get(infos, timeout=timeout)):
                s.addr, s.server_pid, s.log_path, s.node_id = (info["addr"], info["pid"], info["log_path"],
                                                               info["node_id"])
            wait_healthy(made, timeout, how=lambda s: f"on Ray node {s.node_id[:12]}")
        except BaseException:
            for s in made:
                self.stop(s)
            raise
        self.started.extend(made)
        if self.record_path is not None:
            for s in made:
                append_jsonl(self.record_path, s.record() | {"t": round(time.time(), 3)})
        return made

    def _wait_placed(self, pgs: Sequence[PlacementGroup]) -> bool:
        """Wait up to place_timeout_s for `pgs`, releasing lost servers' groups between short waits: right
        after a node dies Ray may not have marked it dead yet, then re-places its groups on a live node, where
        they would hold the accelerators these new groups wait for until the timeout."""
        deadline = time.monotonic() + self.place_timeout_s
        while True:
            left = deadline - time.monotonic()
            if wait_ready(pgs, max(0.0, min(5.0, left))):
                return True
            if left <= 5.0:
                return False
            self.release_lost()

    def release_lost(self) -> int:
        """Remove the placement groups of known servers whose node is gone: Ray would otherwise re-place
        them on a live node, where they hold the accelerators their replacements need."""
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        table = ray.util.placement_group_table()

        def moved(s: RayServer) -> bool:  # its group re-placed (or being re-placed) away from its server's node
            if s.pg is None:
                return False
            info = table.get(s.pg.id.hex(), {})
            nodes = set((info.get("bundles_to_node_id") or {}).values())
            return info.get("state") == "RESCHEDULING" or bool(nodes and s.node_id not in nodes)

        lost = [s for s in self.started if s.node_id and (s.node_id not in alive or moved(s))]
        for s in lost:
            with contextlib.suppress(Exception):
                ray.kill(s.actor)
            if s.pg is not None:
                with contextlib.suppress(Exception):
                    remove_placement_group(s.pg)
            self.started.remove(s)
        return len(lost)

    def stop(self, server: RayServer, timeout: float = 10.0) -> None:
        if server in self.started:
            self.started.remove(server)
        with contextlib.suppress(Exception):  # a lost node: the actor is gone with its process
            ray.get(server.actor.stop.remote(timeout), timeout=timeout + 15)
        with contextlib.suppress(Exception):
            ray.kill(server.actor)
        if server.pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(server.pg)

    def adopt(self, addr: str, spec: ServerSpec, run_dir: str) -> RayServer | None:
        """A server the launcher started as a Ray actor (its ray_servers.jsonl entry: actor name, placement
        group, node): a handle whose stop removes the actor and its group too; None when there is no entry
        or the actor is gone."""
        # ray_servers.jsonl, not servers.json: the fleet rewrites the registry in its own format (no actor)
        entry = next((r for r in reversed(read_ray_servers(run_dir)) if r.get("addr") == addr), None)
        name = entry.get("actor") if entry else None
        if not name:
            return None
        try:
            actor = ray.get_actor(name, namespace=self.namespace)
        except ValueError:
            return None
        pg = None
        if entry.get("pg"):  # by id: a group's name is not visible to another job's lookup
            pg = PlacementGroup(ray.PlacementGroupID(bytes.fromhex(str(entry["pg"]))))
        s = RayServer(str(entry["addr"]), spec, str(entry.get("log", "")), actor, pg,
                      str(entry.get("node_id", "")), entry.get("pid"), name)
        self.started.append(s)
        return s


def read_ray_servers(run_dir: str | os.PathLike) -> list[dict]:
    """Every server started on Ray in this run (the launcher's and the trainer's), oldest first."""
    return read_jsonl(os.path.join(run_dir, RAY_SERVERS_FILE))


def connect(address: str, namespace: str, timeout_s: float = 60.0) -> None:
    """Join the Ray cluster at `address` (never start one) in the run's namespace."""
    if ray.is_initialized():
        return
    ray.init(address=address, namespace=namespace, log_to_driver=False, configure_logging=False,
             include_dashboard=False)


def remove_run(namespace: str) -> tuple[int, int]:
    """Kill every named actor of the run's namespace and remove every placement group it created; (actors,
    groups) removed. What the launcher does at the end, whatever happened."""
    from ray.util import list_named_actors

    n_actors = 0
    for a in list_named_actors(all_namespaces=True):
        if a.get("namespace") != namespace:
            continue
        with contextlib.suppress(Exception):
            ray.kill(ray.get_actor(a["name"], namespace=namespace))
            n_actors += 1
    n_pgs = 0
    for pg_id, info in ray.util.placement_group_table().items():
        if info.get("state") == "REMOVED" or not str(info.get("name", "")).startswith(f"{namespace}."):
            continue
        with contextlib.suppress(Exception):
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))
            n_pgs += 1
    return n_actors, n_pgs
