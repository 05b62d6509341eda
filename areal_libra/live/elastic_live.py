"""Elastic Hybrid Pool in a live AReaL run (SPMD trainer, FSDP engine, fsdp:d1 on the CPU cluster).

The trainer calls, once the PPOTrainer exists:

    elastic = install_elastic(trainer, libra, run_dir, metrics)   # None when not enabled
    ...
    finally:
        if elastic is not None:
            elastic.close()

Configuration: `libra.elastic` (`LiveElasticConfig`: enabled, hybrids, the runtime's settings, a hybrid's
server), e.g. `libra.elastic.enabled=true libra.elastic.hybrids=1`; the join/release thresholds are the
controller's (`libra.control.elastic_policy`).

What it does: starts a TCPStore (loopback) and `hybrids` worker processes (`elastic_worker`, each its own
FSDPEngine built from the run's AReaL config), installs the FSDP hook on the actor engine (domain
reduction, batch sharing, snapshots). A hybrid in rollout serves requests on its own embedded server,
registered with the trainer's AReaL engine and request router (`elastic_serving.ServeRegistry`: routable
once it holds the latest weights, drained with no request lost when it joins). Before each training step
it measures T_train, T_rollout (from the trainer's wait for its batch and the rollout side's idle time,
`elastic.measure.rollout_time`) and the rollout servers' pressure. It decides nothing: the shared
LibraController (areal_libra.control, the one elastic decision loop) does, through the LiveCluster, which
calls `pool_view()`, `join(n)`, `release(n)` and reads `observation()`; with `join_at_step` /
`release_after` set its policy is the fixed script (elastic.policy.ScheduledPolicy, demonstrations).
Per-step `elastic/*` keys go to metrics.jsonl through `metrics.add_source`.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from areal_libra.config import LiveElasticConfig, libra_config
from areal_libra.control.controller import PoolView, StepObservation
from areal_libra.elastic.measure import RolloutIdleClock, rollout_time
from areal_libra.elastic.policy import LEND_IN_FILL, hybrid_count, hybrid_server_tp
from areal_libra.elastic.state import JOINING, Pool, ReplicaState
from areal_libra.elastic_runtime.core import ElasticCore
from areal_libra.live.elastic_hook import FSDPElasticHook
from areal_libra.live.elastic_serving import ServeRegistry
from areal_libra.rollout.emulation import ClusterEmulation

log = logging.getLogger(__name__)


def load_config(libra: Any) -> LiveElasticConfig:
    """`libra.elastic`, typed (from the run's LibraConfig, or a `libra:` mapping checked as at launch)."""

    return libra_config(libra if libra is not None else {}).elastic


def hybrids_serve(libra: Any) -> bool:
    """Whether this run's hybrid replicas serve rollout (then the trainer needs the request router)."""
    cfg = load_config(libra)
    return bool(cfg.enabled and cfg.serve and cfg.hybrids > 0)


def follow_in_flight(manager: Any, clock: RolloutIdleClock) -> bool:
    """Feed `clock` the in-flight rollout count of AReaL's StalenessManager after every submit, accept and
    reject (instance attributes: this manager only). False when there is no such manager."""
    if manager is None or not hasattr(manager, "rollout_stat"):
        return False
    for name in ("on_rollout_submitted", "on_rollout_accepted", "on_rollout_rejected"):
        fn = getattr(manager, name)

        def counted(*a: Any, _fn: Any = fn, **k: Any) -> Any:
            out = _fn(*a, **k)
            clock.on_change(int(manager.rollout_stat.running))
            return out

        setattr(manager, name, counted)
    return True


class ElasticPoolControl:
    """pool_view / join / release over the core's pool, for the shared LibraController (via the LiveCluster)."""

    def __init__(self, core: ElasticCore, cfg: LiveElasticConfig, router: Any = None, inference: Any = None,
                 registry: Any = None, device: str = "cpu", unit: int | None = None) -> None:
        """`unit`: accelerators of one hybrid (a pool sized with the plan: the plan's tp x pp); None: one
        server's size (one TP1 server's accelerators, its threads on CPU)."""
        self.core, self.cfg, self.router, self.inference = core, cfg, router, inference
        self.registry, self.device, self.unit = registry, device, unit
        self.asked = {"join": 0, "release": 0}
        # The trainer's core in hybrid units (an emulated cluster: its trainer accelerators); None: one
        # data-parallel replica, the single-rank FSDP core.
        self.core_fn: Any = None

    def ready(self, rid: str) -> bool:
        return self.core.kv.has(f"hb/{rid}/0")

    def _server_size(self, tp: int, threads: int) -> int:
        # Accelerators of a server: its TP degree on GPU, its threads on CPU ("TP t = t threads").
        return max(1, int(tp)) if self.device != "cpu" else max(1, int(threads), int(tp))

    def pool_view(self) -> PoolView:
        pool = self.core.pool
        training = pool.in_state(ReplicaState.TRAINING)
        idle = [h for h in pool.in_state(ReplicaState.ROLLOUT) if self.ready(h.rid)]
        unit = self.unit or self._server_size(1, self.cfg.server_threads)
        rollout = 0
        if self.router is not None:
            hybrid = {addr for addr, _ in self.registry.serving().values()} if self.registry is not None else set()
            for g, addrs in zip(self.router.groups, self.router.group_addrs):
                rollout += self._server_size(g.tp, g.threads) * sum(a not in hybrid for a in addrs)
            rollout += unit * len(hybrid)
        elif self.inference is not None:
            rollout = len(self.inference.addresses)
        core = max(1, int(self.core_fn()) // unit) if self.core_fn is not None else 1
        return PoolView(training=len(training), idle=len(idle), train_replicas=core + len(training),
                        rollout_gpus=rollout, unit_gpus=unit,
                        busy=bool(pool.in_state(*JOINING, ReplicaState.RELEASING)))

    def join(self, n: int, step: int | None = None) -> int:
        """Ask up to n idle (ready) hybrid replicas to join training; returns how many were asked."""
        if n <= 0:
            return 0
        idle = sorted(h.rid for h in self.core.pool.in_state(ReplicaState.ROLLOUT) if self.ready(h.rid))
        done = sum(self.core.request_join(rid) for rid in idle[:n])
        self.asked["join"] += done
        return done

    def release(self, n: int, step: int | None = None) -> int:
        """Ask up to n training hybrid replicas to go back to rollout (newest id first); returns how many."""
        if n <= 0:
            return 0
        active = sorted((h.rid for h in self.core.pool.in_state(ReplicaState.TRAINING)), reverse=True)
        done = sum(self.core.request_release(rid) for rid in active[:n])
        self.asked["release"] += done
        return done


class LiveElastic:
    # How the pool started (set by __init__; the defaults describe a pool that starts in rollout)
    start_training = False
    lend_in_fill = False
    resumed = False

    def __init__(self, engine: Any, run_dir: Path, cfg: LiveElasticConfig, inference: Any = None,
                 router: Any = None, batch_size: int = 1, device: str = "cpu",
                 pacing: dict[str, Any] | None = None, fleet: Any = None, pressure: Any = None,
                 unit: int | None = None, host_tp: int | None = None, start_training: bool = False,
                 lend_in_fill: bool = False) -> None:
        """engine: the actor FSDPEngine; inference: the RemoteInfEngine holding `addresses` (None: hybrids
        do not serve); router: the RequestRouter (hybrid servers need it to be routed to and drained);
        pacing: a hybrid's server's pacing, ServerPacing fields (an emulated cluster: rollout.emulation);
        fleet: the rollout ServerFleet, through which the hybrids' servers attach and detach; pressure:
        the run's rollout.pressure.PressureSampler (its owner closes it; None: pressure reads 0).
        A pool sized with the plan: `unit` accelerators a hybrid; `host_tp`: on an emulated host a hybrid
        in rollout serves as one emulated server of that TP inside the host (rollout.emulated_host);
        `start_training`: every hybrid joins training once its worker is ready (the simulator's pool starts
        training) and serves rollout only when the controller releases it; with `lend_in_fill` it serves from its
        start and joins at the first training step it is ready for (elastic.policy.LEND_IN_FILL)."""
        import torch.distributed as dist

        if int(engine.data_parallel_world_size) != 1:
            raise ValueError("the live elastic pool supports a single-rank core (fsdp:d1) for now")
        self.cfg = cfg
        self.device = device
        self.dir = run_dir / "elastic"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        rt = cfg.runtime
        self.rids = [f"h{i}" for i in range(cfg.hybrids)]
        self.core = ElasticCore(self.store, rt, 0, 1, None, str(self.dir / "snapshots"), state_fn=dict,
                                hybrids=[(rid, 1) for rid in self.rids])
        self.hook = FSDPElasticHook.install(engine, self.core)
        self.hook.before_step = self._before_step
        self.router, self.inference = router, inference
        self.serve = bool(cfg.serve and inference is not None and router is not None and fleet is not None)
        if cfg.serve and not self.serve:
            log.warning("libra.elastic.serve: no request router, inference engine or rollout fleet; hybrids idle "
                        "in rollout")
        self.registry = None
        if self.serve:

            self.registry = ServeRegistry("127.0.0.1", self.store.port, rt.namespace, self.rids, fleet,
                                          group=cfg.rollout_group)
        self.idle_measured = False
        self.pressure = pressure
        self.procs: list[subprocess.Popen] = []
        env = dict(os.environ)
        # Workers block on store keys in 2 s slices; c10d logs a warning per slice otherwise.
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        for rid in self.rids:
            cmd = [sys.executable, "-m", "areal_libra.live.elastic_worker",
                   "--store", f"127.0.0.1:{self.store.port}", "--rid", rid,
                   "--snapshot-dir", str(self.dir / "snapshots"), "--config", str(run_dir / "areal_config.yaml"),
                   "--runtime", json.dumps(asdict(rt))]
            if self.serve:
                cmd += ["--serve", "--server-threads", str(cfg.server_threads), "--server-max-running",
                        str(cfg.server_max_running), "--ack-timeout", str(cfg.serve_ack_timeout_s)]
                if host_tp is not None:
                    cmd += ["--emulated-host-tp", str(int(host_tp))]
                elif pacing:
                    cmd += ["--pacing", json.dumps(pacing)]
                if start_training and not lend_in_fill:
                    cmd += ["--serve-after-join"]
            log_f = open(self.dir / f"{rid}.log", "w")  # noqa: SIM115 - lives as long as the worker
            self.procs.append(subprocess.Popen(cmd, env=env, stdout=log_f, stderr=subprocess.STDOUT,
                                               start_new_session=True))
        self.batch_size = max(1, int(batch_size))
        self.t_train = 0.0
        self.t_iter_start: float | None = None
        self.wait_s: float | None = None  # the trainer's wait for this step's batch (prepare_batch)
        self.backlog = 0
        self.idle = RolloutIdleClock()
        self.idle_s: float | None = None  # the rollout side's idle time in the last step (None: not measured)
        self.interval_s: float | None = None  # the last step's wall time, as the pool timed it
        self.last_obs: StepObservation | None = None
        self.pool = ElasticPoolControl(self.core, cfg, router, inference, self.registry, device, unit)
        self._routed0: dict[str, int] = {}
        # hybrids to bring into training once their workers are ready: after a restart (resume), or all of a
        # pool that starts training
        self.rejoin: list[str] = list(self.rids) if start_training else []
        self.starting: set[str] = set(self.rejoin)  # joining for the first time (training_hybrids)
        self.unit, self.host_tp, self.start_training = unit, host_tp, start_training
        self.lend_in_fill = bool(start_training and lend_in_fill and self.serve)
        self.resumed = False
        (self.dir / "config.json").write_text(json.dumps(asdict(cfg)))

    # -- measurements ------------------------------------------------------------------------------
    def watch_rollout(self, actor: Any, executor: Any = None) -> None:
        """Time the trainer's wait for each batch (`actor.prepare_batch`) and, after it, the finished groups
        left over beyond the batch (the workflow executor's pending results); and the rollout side's idle
        time: the executor's in-flight count, followed through its staleness manager's callbacks."""
        original = actor.prepare_batch
        manager = None
        try:
            manager = executor.staleness_manager if executor is not None else None
        except RuntimeError:  # not initialised: no idle measurement, the backlog rule applies
            manager = None
        self.idle_measured = follow_in_flight(manager, self.idle) if self.cfg.rollout_clock else False

        def prepare_batch(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = original(*args, **kwargs)
            self.wait_s = time.perf_counter() - t0
            pending = getattr(getattr(executor, "dispatcher", None), "_pending_results", None)
            self.backlog = len(pending) if pending is not None else 0
            return out

        actor.prepare_batch = prepare_batch

    def _measure(self, step: int, t_train_s: float) -> StepObservation | None:
        now = time.monotonic()
        t_iter = now - self.t_iter_start if self.t_iter_start is not None else None
        self.t_iter_start = now
        q, a = self.pressure.take() if self.pressure is not None else (0.0, 0.0)
        idle = self.idle.take()
        if t_iter is None:
            return None
        self.idle_s = idle if self.idle_measured else None
        self.interval_s = t_iter
        if self.wait_s is not None:
            # Finished groups left beyond the batch: the trainer's wait was its own (taking and collating
            # the batch on this machine's CPU), not for the batch to fill (the simulator's waited_for "count").
            t_roll = rollout_time(t_train_s, self.wait_s, self.backlog, self.batch_size,
                                  waited_for_count=self.backlog == 0, idle_s=self.idle_s,
                                  interval_s=t_iter)
        else:  # no prepare_batch seen: the rest of the iteration is the rollout side's share
            t_roll = max(t_iter - t_train_s, 1e-6)
        self.last_obs = StepObservation(step=step, interval_s=t_iter, train_s=t_train_s, rollout_s=t_roll,
                                        queue_pressure=q, active_pressure=a)
        return self.last_obs

    def observation(self) -> StepObservation | None:
        """The latest step's measurements (for the LiveCluster's StepObservation)."""
        return self.last_obs

    def rollout_inputs(self) -> dict[str, Any] | None:
        """What the latest T_rollout was computed from (wait, backlog, batch, idle), so that the controller's
        observation can apply the same rule on AReaL's fuller train time; None before a batch was seen."""
        if self.wait_s is None:
            return None
        return {"wait_s": self.wait_s, "backlog": self.backlog, "batch": self.batch_size, "idle_s": self.idle_s,
                "interval_s": self.interval_s}

    # -- the pool as the shared controller sees it (ElasticPoolControl) -------------------------------
    def pool_view(self) -> PoolView:
        return self.pool.pool_view()

    def join(self, n: int, step: int | None = None) -> int:
        return self.pool.join(n, step)

    def release(self, n: int, step: int | None = None) -> int:
        return self.pool.release(n, step)

    def _ready(self, rid: str) -> bool:
        return self.pool.ready(rid)

    def training_hybrids(self) -> int:
        """Hybrid replicas training now (an emulated trainer counts their accelerators). A pool that starts
        training counts its hybrids from the first plan on: they are the plan's training replicas, and their
        workers' start (a CPU process building its engine) is this machine's time, not the emulated hardware's."""
        pool = self.core.pool
        training = {h.rid for h in pool.in_state(ReplicaState.TRAINING)}
        joining = {h.rid for h in pool.in_state(*JOINING)}
        self.starting = {r for r in self.starting if r not in training and (r in self.rejoin or r in joining)}
        return len(training) + len(self.starting)

    def describe(self) -> str:
        """One line for control_events.jsonl: the pool's size and where its hybrids start."""
        unit = self.unit or 1
        serve = f"; released, each serves as one TP{self.host_tp} emulated server" if self.host_tp else ""
        start = ("rollout through the fill (each joins training at the first step its worker is ready for)"
                 if self.lend_in_fill else
                 "training (each joins once its worker is ready)" if self.start_training else "rollout")
        return f"{len(self.rids)} hybrid replica(s) of {unit} accelerator(s), starting in {start}{serve}"

    # -- resuming after a restart (live.recover) ----------------------------------------------
    def resume(self, state: dict) -> list[str]:
        """Take the saved pool's counters, and have the hybrids that were training (or joining) re-join
        through the join protocol once their restarted workers are ready: a restarted worker holds no weights,
        so it cannot be marked training directly. Returns their ids; ValueError on a malformed state."""
        saved = Pool.from_state(state)
        self.core.pool.counters = saved.counters
        self.resumed = True  # past its fill: the hybrids re-join
        self.rejoin = sorted(h.rid for h in saved.in_state(ReplicaState.TRAINING, *JOINING) if h.rid in self.rids)
        return list(self.rejoin)

    def _rejoin_ready(self, step: int | None = None) -> None:
        for rid in list(self.rejoin):
            if self._ready(rid):
                asked = self.core.request_join(rid)
                self.rejoin.remove(rid)
                if self.start_training and not self.resumed:
                    print(f"areal_libra elastic: step {step}: hybrid {rid} joins training (the plan's replica"
                          f"{'; lent to rollout until this first step' if self.lend_in_fill else ''})", flush=True)
                    continue
                print(f"areal_libra recover: step {step}: hybrid {rid} (training before the restart) "
                      f"{'asked to re-join training' if asked else 'could not re-join (not in rollout)'}", flush=True)

    # -- per step ----------------------------------------------------------------------------------
    def _before_step(self, step: int, t_train_s: float) -> None:
        self._measure(step, t_train_s)  # the controller reads it after the step (observation())
        self._rejoin_ready(step)

    def step_metrics(self) -> dict[str, float]:
        out = self.hook.step_metrics()
        out["elastic/hybrid_processes_alive"] = float(sum(p.poll() is None for p in self.procs))
        o = self.last_obs
        if o is not None:
            out.update({"elastic/t_train_s": o.train_s, "elastic/t_rollout_s": o.rollout_s,
                        "elastic/queue_pressure": o.queue_pressure, "elastic/rollout_pressure": o.active_pressure})
        if self.wait_s is not None:
            out["elastic/rollout_wait_s"] = self.wait_s
            out["elastic/rollout_backlog"] = float(self.backlog)
        if self.idle_s is not None:
            out["elastic/rollout_idle_s"] = self.idle_s
        if self.registry is not None:
            serving = self.registry.serving()
            out["elastic/hybrids_serving"] = float(len(serving))
            out["elastic/serve_registrations"] = float(self.registry.registrations)
            out["elastic/serve_removals"] = float(self.registry.removals)
            # Requests the router sent to hybrid servers since the last step (and in total).
            counts = dict(self.router.addr_requests)
            hyb = set(self.registry.active_ever)
            routed = sum(max(0, counts.get(a, 0) - self._routed0.get(a, 0)) for a in hyb)
            self._routed0 = {a: counts.get(a, 0) for a in hyb}
            out["elastic/hybrid_routed"] = float(routed)
            out["elastic/hybrid_routed_total"] = float(sum(counts.get(a, 0) for a in hyb))
        return out

    def close(self) -> None:
        try:
            self.core.shutdown()
        finally:
            for p in self.procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
            if self.registry is not None:
                self.registry.close()


def install_elastic(trainer: Any, libra: Any, run_dir: Path, metrics: Any, fleet: Any = None,
                    pressure: Any = None) -> LiveElastic | None:
    """The pool of a live run; `fleet`: the rollout ServerFleet (hybrids serve through it; train.install_fleet);
    `pressure`: the run's one pressure sampler (train.rollout_pressure)."""

    cfg = load_config(libra)
    if not cfg.enabled or cfg.size_with_plan:  # sized with the plan: built at the first plan (plan_pool_factory)
        return None
    rollout = getattr(trainer, "rollout", None)
    inference = getattr(rollout, "_engine", rollout)  # RemoteSGLangEngine wraps the RemoteInfEngine
    if inference is not None and not hasattr(inference, "addresses"):
        inference = None
    router = getattr(inference, "request_router", None) if inference is not None else None
    libra = libra_config(libra)
    device = libra.device
    batch = int(trainer.config.train_dataset.batch_size) if hasattr(trainer, "config") else 1

    emu = ClusterEmulation.from_libra(libra)
    live = LiveElastic(trainer.actor, Path(run_dir), cfg, inference=inference, router=router, batch_size=batch,
                       device=device, pacing=emu.hybrid_pacing().as_dict() if emu is not None else None,
                       fleet=fleet, pressure=pressure)
    live.watch_rollout(trainer.actor, getattr(rollout, "workflow_executor", None))
    metrics.add_source(live.step_metrics)
    return live


def plan_pool_factory(trainer: Any, libra: Any, run_dir: Path, metrics: Any, fleet: Any = None,
                      pressure: Any = None) -> Any:
    """libra.elastic.size_with_plan: `build(plan, cluster)` makes the pool when the first plan is applied (the
    LiveControl calls it): hybrid_count(plan DP, libra.elastic.hybrids) of the plan's training replicas, tp x pp
    accelerators each (elastic.policy, as the simulator's Libra), starting in training; on an emulated host a
    released hybrid serves as one emulated server of hybrid_server_tp(unit, TP of the largest rollout group)
    inside the host. None when the pool is off or not sized with the plan."""
    cfg = load_config(libra)
    if not (cfg.enabled and cfg.size_with_plan):
        return None
    libra = libra_config(libra)

    def build(plan: Any, cluster: Any) -> LiveElastic | None:
        t = plan.train
        n, unit = hybrid_count(t.dp, cfg.hybrids), int(t.tp) * int(t.pp)
        if n <= 0:
            return None
        groups = list(cluster.groups)
        big = max(groups, key=lambda g: (g.tp * g.count, g.tp), default=None)
        host_tp = hybrid_server_tp(unit, big.tp if big is not None else 1) if libra.emulated.host else None
        emu = getattr(cluster, "emulation", None)
        if emu is not None:
            emu.set_plan_pool(n, unit)
        rollout = getattr(trainer, "rollout", None)
        inference = getattr(rollout, "_engine", rollout)
        if inference is not None and not hasattr(inference, "addresses"):
            inference = None
        router = getattr(inference, "request_router", None) if inference is not None else None
        batch = int(trainer.config.train_dataset.batch_size) if hasattr(trainer, "config") else 1
        live = LiveElastic(trainer.actor, Path(run_dir), replace(cfg, hybrids=n), inference=inference,
                           router=router, batch_size=batch, device=libra.device, fleet=fleet, pressure=pressure,
                           unit=unit, host_tp=host_tp, start_training=True, lend_in_fill=LEND_IN_FILL,
                           pacing=emu.pacing(host_tp or 1).as_dict() if emu is not None and host_tp is None else None)
        if emu is not None:  # the pool's overshoot projection counts the trainer's core in hybrid units
            live.pool.core_fn = lambda: emu.check_layout(cluster.groups)[1] - n * unit
        live.watch_rollout(trainer.actor, getattr(rollout, "workflow_executor", None))
        metrics.add_source(live.step_metrics)
        return live

    return build
