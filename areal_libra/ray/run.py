"""A launch on Ray (cluster=ray, cluster=ray_local): every process of the run placed by a placement group.

    python -m areal_libra.launch experiment=dapo_math cluster=ray_local     # 2 Ray nodes started on this host
    python -m areal_libra.launch experiment=dapo_math cluster=ray libra.ray.address=HEAD_IP:6379

What happens, in order (areal_libra/launch.py hands over after the config, the model and the plan check):
1. The Ray cluster: ray_local starts `libra.ray.local_nodes` raylets here (ray/cluster.py); otherwise the
   driver joins `libra.ray.address` ("auto": RAY_ADDRESS or the cluster `ray start` made on this machine).
   Every live node must import the project (one small actor per node says so).
2. The training layout: `libra.ray.trainer_ranks`, or the planner's (its training plan's data-parallel size
   on `libra.control.accelerators`, capped by `libra.ray.max_trainer_ranks`); actor.backend becomes fsdp:dN.
3. Resources: the trainer's N accelerators on one node (STRICT_PACK; PACK when no node has N) plus every
   server's TP on one node; too few is one line before anything starts.
4. The trainer's placement group, then the rollout servers through RayBackend (nodes without trainer ranks
   first), then N trainer ranks (`python -m areal_libra.live.train`, torch.distributed over gloo on CPU,
   NCCL on GPU), rank r in bundle r; MASTER_ADDR is rank 0's node IP.
5. placement.json: every process with role, Ray node id, accelerators and PID, rewritten (atomically) as the
   fleet replaces servers.
6. At the end, whatever happened: trainer ranks and servers stopped, every actor and placement group of
   the run's namespace removed, the local cluster's processes ended by PID.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from areal_libra.config import Composed, save
from areal_libra.ray.backend import (
    ADDRESS_ENV,
    NAMESPACE_ENV,
    RAY_SERVERS_FILE,
    TRAINER_NODES_ENV,
    ProcessHost,
    RayBackend,
    RayServer,
    free_accel_per_node,
    host_options,
    read_ray_servers,
    remove_run,
    wait_ready,
)
from areal_libra.ray.cluster import ACCEL, LocalRayCluster, RayClusterError
from areal_libra.rollout.launcher import ServerLaunchError
from areal_libra.utils import append_jsonl, atomic_write_text, first_line

PLACEMENT_FILE = "placement.json"


def on_ray(c: Composed) -> bool:
    r = c.libra.ray
    return bool(r.address) or int(r.local_nodes) > 0


@dataclass
class Hooks:
    """What the launcher lends this module (launch.py imports this module, not the other way round)."""

    server_specs: Callable[[Composed], list]
    trainer_env: Callable[..., dict[str, str]]
    supervise: Callable[..., int]
    groups: Callable[[Composed], list]
    train_plan: Callable[[Composed, str], Any]  # the planner's worst-case plan (live/live_cluster.plan_source)


def connect_cluster(c: Composed, log_dir: Path, namespace: str) -> LocalRayCluster | None:
    """Start (ray_local) or join the Ray cluster; the local cluster to stop at the end, if one was started."""
    r = c.libra.ray
    local = None
    if int(r.local_nodes) > 0:
        local = LocalRayCluster(int(r.local_nodes), int(r.local_cpus), int(r.local_accel),
                                str(log_dir / "ray"), float(r.timeout_s)).start()
        os.environ.update(RAY_TMPDIR=local.temp_dir, RAY_AUTH_MODE="disabled")
        os.environ.pop("RAY_ADDRESS", None)
        address = local.address
        print(f"areal_libra: local Ray cluster at {address}: {r.local_nodes} nodes x {r.local_cpus} CPU, "
              f"{r.local_accel} accel (logs {log_dir / 'ray'})", flush=True)
    else:
        address = str(r.address)
        host, _, port = address.rpartition(":")
        if host and port.isdigit():  # Ray retries a dead address for minutes: ask the port first
            try:
                socket.create_connection((host, int(port)), timeout=10).close()
            except OSError as e:
                raise RayClusterError(f"libra.ray.address={address}: no Ray cluster answers there ({e}); start "
                                      "one with `ray start --head` or use cluster=ray_local") from None
    c.libra.ray.address = address
    try:
        ray.init(address=address, namespace=namespace, log_to_driver=False, configure_logging=False,
                 include_dashboard=False)
    except Exception as e:  # noqa: BLE001 - ConnectionError, ValueError, RuntimeError: all "no cluster there"
        if local is not None:
            local.stop()
        raise RayClusterError(f"libra.ray.address={address}: no Ray cluster answers there ({first_line(e)}); "
                              "start one with `ray start --head` or use cluster=ray_local") from None
    return local


def check_nodes(timeout_s: float) -> dict[str, dict]:
    """Every live node: its IP, accelerators, and whether it imports the project (one actor per node)."""
    nodes = {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}
    probes = {nid: ProcessHost.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False))
              .remote() for nid in nodes}
    out = {}
    try:
        for nid, actor in probes.items():
            try:
                info = ray.get(actor.node.remote(), timeout=timeout_s)
            except Exception as e:  # noqa: BLE001 - the actor could not start there: the project is missing
                raise RayClusterError(f"Ray node {nid[:12]} ({nodes[nid].get('NodeManagerAddress')}) cannot run "
                                      f"the project's actors ({first_line(e)}); install areal_libra on every "
                                      "node (same path and venv)") from None
            if not info["project"]:
                raise RayClusterError(f"Ray node {nid[:12]} has no areal_libra; install it on every node")
            out[nid] = {"ip": info["ip"], "accel": float(nodes[nid]["Resources"].get(ACCEL, 0.0))}
    finally:
        for actor in probes.values():
            with contextlib.suppress(Exception):
                ray.kill(actor)
    return out


def training_ranks(c: Composed, hooks: Hooks, model_path: str) -> tuple[int, str]:
    """(trainer ranks, why): `libra.ray.trainer_ranks`, else the planner's training data-parallel size."""
    r = c.libra.ray
    if int(r.trainer_ranks) > 0:
        return int(r.trainer_ranks), f"libra.ray.trainer_ranks={r.trainer_ranks}"
    plan = hooks.train_plan(c, model_path)
    dp = int(plan.train.dp)
    cap = int(r.max_trainer_ranks)
    n = min(dp, cap) if cap > 0 else dp
    why = f"the planner's training layout {plan.train_alloc()}"
    return n, why + (f", capped at libra.ray.max_trainer_ranks={cap}" if n < dp else "")


def check_resources(nodes: dict[str, dict], ranks: int, server_tps: list[int]) -> str:
    """The plan's accelerators against the cluster's (the trainer's on one node when any node has that
    many); the trainer's placement strategy, or a one-line RayClusterError."""
    free = free_accel_per_node()
    per_node = sorted((free.get(nid, 0.0) for nid in nodes), reverse=True)
    need = ranks + sum(server_tps)
    if sum(per_node) < need or (server_tps and max(server_tps) > (per_node[0] if per_node else 0)):
        raise RayClusterError(f"the plan needs {need} accel ({ranks} trainer ranks + servers TP "
                              f"{'+'.join(map(str, server_tps))}) but the Ray cluster has "
                              f"{sum(per_node):g} free ({', '.join(f'{x:g}' for x in per_node)} per node)")
    return "STRICT_PACK" if per_node and per_node[0] >= ranks else "PACK"


class RayTrainer:
    """The trainer's ranks as processes of ProcessHost actors; `poll`/`send_signal`/`pid` as supervise()
    expects of a Popen (rank 0's; any rank failing is the trainer failing)."""

    def __init__(self, actors: list[Any], pids: list[int]) -> None:
        self.actors = actors
        self.pids = pids

    @property
    def pid(self) -> int:
        return self.pids[0]

    def poll(self) -> int | None:
        try:
            codes = ray.get([a.poll.remote() for a in self.actors], timeout=30)
        except Exception:  # noqa: BLE001 - a rank's actor or node is gone: the trainer failed
            return 1
        bad = [x for x in codes if x not in (None, 0)]
        if bad:
            return bad[0]
        return 0 if all(x == 0 for x in codes) else None

    def send_signal(self, sig: int) -> None:
        for a in self.actors:
            with contextlib.suppress(Exception):
                ray.get(a.signal.remote(int(sig)), timeout=10)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            ray.get([a.stop.remote(20.0) for a in self.actors], timeout=60)


def start_trainer(c: Composed, hooks: Hooks, log_dir: Path, addrs: list[str], pg: Any, ranks: int,
                  nodes: dict[str, dict], namespace: str, bundle_nodes: list[str]) -> RayTrainer:
    actors = [ProcessHost.options(**host_options(pg, r, 1, f"{namespace}.trainer-{r}", namespace)).remote()
              for r in range(ranks)]
    master = nodes[bundle_nodes[0]]["ip"]
    port = ray.get(actors[0].free_port.remote(master), timeout=60)
    pids = []
    for r, a in enumerate(actors):
        env = hooks.trainer_env(c, addrs)
        env.update(RANK=str(r), LOCAL_RANK=str(sum(1 for n in bundle_nodes[:r] if n == bundle_nodes[r])),
                   WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(bundle_nodes.count(bundle_nodes[r])),
                   MASTER_ADDR=master, MASTER_PORT=str(port))
        env.update({ADDRESS_ENV: str(c.libra.ray.address), NAMESPACE_ENV: namespace,
                    TRAINER_NODES_ENV: ",".join(sorted(set(bundle_nodes)))})
        log = log_dir / ("trainer.log" if r == 0 else f"trainer_rank{r}.log")
        pids.append(ray.get(a.start.remote([sys.executable, "-m", "areal_libra.live.train", "--run-dir",
                                            str(log_dir)], env, str(log)), timeout=60))
    return RayTrainer(actors, pids)


def write_placement(log_dir: Path, trainer: list[dict], servers: list[RayServer]) -> dict:
    """placement.json: every process of the run (trainer ranks, serving rollout servers, the launcher) with
    its role, Ray node id, accelerators and PID; the servers as servers.json lists them now."""
    from areal_libra.rollout.fleet import read_registry

    known = {s.addr: s.record() for s in servers}
    for rec in read_ray_servers(log_dir):
        if "addr" in rec:
            known[rec["addr"]] = rec
    procs = [dict(t) for t in trainer]
    for entry in read_registry(log_dir):
        if entry.get("state") not in ("serving", "draining"):
            continue
        rec = known.get(entry.get("addr"), {})
        procs.append({"role": "rollout", "group": entry.get("group"), "addr": entry.get("addr"),
                      "node_id": rec.get("node_id", ""), "accel": entry.get("tp"), "pid": entry.get("pid"),
                      "state": entry.get("state")})
    procs.append({"role": "launcher", "node_id": ray.get_runtime_context().get_node_id(), "accel": 0,
                  "pid": os.getpid()})
    body = {"t": round(time.time(), 3), "processes": procs,
            "nodes": sorted({p["node_id"] for p in procs if p.get("node_id")})}
    atomic_write_text(log_dir / PLACEMENT_FILE, json.dumps(body, indent=1) + "\n")
    return body


class _Watcher(threading.Thread):
    """Keeps placement.json current and, for a chaos run (libra.ray.kill_node_at_step), kills the raylet of
    the node that holds only rollout servers once the metrics reach that step."""

    def __init__(self, log_dir: Path, trainer: list[dict], servers: list[RayServer], local: LocalRayCluster | None,
                 kill_at: int | None, trainer_nodes: set[str]) -> None:
        super().__init__(name="ray-placement", daemon=True)
        self.log_dir, self.trainer, self.servers = log_dir, trainer, servers
        self.local, self.kill_at, self.trainer_nodes = local, kill_at, trainer_nodes
        self.stop_event = threading.Event()
        self.killed: dict | None = None

    def _step(self) -> int:
        try:
            lines = (self.log_dir / "metrics.jsonl").read_text().splitlines()
            return int(json.loads(lines[-1]).get("step", 0)) if lines else 0
        except (OSError, ValueError):
            return 0

    def _kill(self) -> None:
        nodes = {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}
        target = next((nid for nid in nodes if nid not in self.trainer_nodes
                       and any(s.node_id == nid for s in self.servers)), None)
        if target is None or self.local is None:
            self.killed = {"error": "no node holds only rollout servers"}
            return
        # which local node is it: the one whose raylet names its node id
        for node in self.local.procs:
            pid = self.local.raylet_pid(node.index)
            if pid is not None and target.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                self.local.kill_node(node.index)
                self.killed = {"node_id": target, "raylet_pid": pid, "step": self._step(), "t": time.time()}
                print(f"areal_libra: killed Ray node {target[:12]} (raylet pid {pid}) at step {self._step()}",
                      flush=True)
                with contextlib.suppress(OSError):
                    atomic_write_text(self.log_dir / "node_kill.json", json.dumps(self.killed) + "\n")
                return

    def run(self) -> None:
        while not self.stop_event.wait(2.0):
            with contextlib.suppress(Exception):
                if self.kill_at is not None and self.killed is None and self._step() >= self.kill_at:
                    self._kill()
                write_placement(self.log_dir, self.trainer, self.servers)


def run_on_ray(c: Composed, hooks: Hooks, log_dir: Path, model_path: str, tool_servers: list,
               revive_grace_s: float) -> int:
    """The run on Ray (see the module doc); raises RayClusterError for what the user can fix."""
    namespace = f"areal_libra.{c.areal.experiment_name}.{c.areal.trial_name}"

    def _interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # SIGTERM too runs the clean-up below (actors, groups, the local cluster)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)
    local = connect_cluster(c, log_dir, namespace)
    backend = None
    servers: list[RayServer] = []
    trainer: RayTrainer | None = None
    watcher: _Watcher | None = None
    try:
        nodes = check_nodes(float(c.libra.ray.timeout_s))
        ranks, why = training_ranks(c, hooks, model_path)
        if ranks > 1 and c.libra.elastic.enabled:
            raise RayClusterError(f"libra.elastic.enabled needs a single-rank trainer core, but the run has {ranks} "
                                  "ranks; set libra.ray.trainer_ranks=1")
        specs = hooks.server_specs(c)
        strategy = check_resources(nodes, ranks, [s.tp for s in specs])
        c.areal.actor.backend = f"fsdp:d{ranks}"
        save(c, log_dir)  # the trainer ranks read the layout from here
        print(f"areal_libra: Ray: {len(nodes)} nodes, {sum(n['accel'] for n in nodes.values()):g} accel; "
              f"trainer fsdp:d{ranks} ({why})", flush=True)
        head = ray.get_runtime_context().get_node_id()
        pg = placement_group([{ACCEL: 1.0}] * ranks, strategy=strategy, name=f"{namespace}.trainer",
                             _soft_target_node_id=head if strategy == "STRICT_PACK" else None)
        if not wait_ready([pg], float(c.libra.ray.timeout_s)):
            remove_placement_group(pg)
            raise RayClusterError(f"Ray could not place {ranks} trainer ranks within {c.libra.ray.timeout_s:g}s")
        bundle_nodes = list(placement_group_table(pg)["bundles_to_node_id"].values())
        backend = RayBackend("embedded", namespace, tuple(sorted(set(bundle_nodes))), float(c.libra.ray.timeout_s))
        try:
            servers = backend.start(model_path, specs, str(log_dir / "servers"))
        except ServerLaunchError as e:
            raise RayClusterError(first_line(e)) from None
        addrs = [s.addr for s in servers]
        print(f"areal_libra: rollout servers {', '.join(f'{s.addr}@{s.node_id[:8]}' for s in servers)}", flush=True)
        from areal_libra.rollout.router import write_groups_file

        write_groups_file(log_dir, hooks.groups(c), addrs)
        reg = {"servers": [{"addr": s.addr, "group": s.spec.group, "tp": s.spec.tp, "pid": s.server_pid,
                            "owner": "launcher", "state": "serving", "log": s.log_path, "gpus": [],
                            "actor": s.name, "node_id": s.node_id, "pg": s.pg.id.hex() if s.pg else None}
                           for s in servers]}
        atomic_write_text(log_dir / "servers.json", json.dumps(reg, indent=1) + "\n")
        for s in servers:  # the trainer's backend adopts them from here (actor, placement group, node)
            append_jsonl(log_dir / RAY_SERVERS_FILE, s.record() | {"t": round(time.time(), 3)})
        trainer = start_trainer(c, hooks, log_dir, addrs, pg, ranks, nodes, namespace, bundle_nodes)
        trainer_recs = [{"role": "trainer", "rank": r, "node_id": bundle_nodes[r], "accel": 1, "pid": pid}
                        for r, pid in enumerate(trainer.pids)]
        write_placement(log_dir, trainer_recs, servers)
        kill_at = c.libra.ray.kill_node_at_step
        watcher = _Watcher(log_dir, trainer_recs, servers, local, None if kill_at is None else int(kill_at),
                           set(bundle_nodes))
        watcher.start()
        rc = hooks.supervise(trainer, log_dir / "metrics.jsonl", int(c.areal.total_train_steps or 0), servers,
                             quiet=True, run_dir=log_dir, revive_grace_s=revive_grace_s, tool_servers=tool_servers,
                             allow_server_loss=bool(c.libra.allow_server_loss))
        watcher.stop_event.set()
        with contextlib.suppress(Exception):
            write_placement(log_dir, trainer_recs, servers)
        return rc
    finally:
        if watcher is not None:
            watcher.stop_event.set()
        if trainer is not None:
            trainer.stop()
        if backend is not None:
            for s in servers:
                backend.stop(s, timeout=5.0)
        with contextlib.suppress(Exception):
            remove_run(namespace)
        with contextlib.suppress(Exception):
            ray.shutdown()
        if local is not None:
            local.stop()
