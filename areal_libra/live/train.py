"""Trainer process: AReaL's PPOTrainer (GRPO) with this project's workflow, metrics and routing.

Started by `areal_libra.launch` in AReaL's SPMD mode (AREAL_SPMD_MODE=1, torch.distributed env set,
AREAL_LLM_SERVER_ADDRS naming the rollout servers):

    python -m areal_libra.live.train --run-dir DIR

It loads the typed LibraConfig the launch validated and saved (DIR/libra_config.yaml, config.load_run_config)
and hands its sections on; nothing here reads a key with a default of its own.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import logging
import os
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from areal_libra.config import LibraConfig, lag_bounded, libra_config, load_run_config
from areal_libra.control.profile import ProfilePass
from areal_libra.elastic.policy import ScheduledPolicy
from areal_libra.live import admission, lag_bound
from areal_libra.live.elastic_live import hybrids_serve, install_elastic, plan_pool_factory
from areal_libra.live.live_cluster import (
    LiveCluster,
    LiveControl,
    fit_profiled_training,
    plan_source,
    run_control_config,
    trajectories_per_step,
)
from areal_libra.live.rank_follower import LayoutFollower
from areal_libra.live.recover import (
    ControlStateFile,
    recover_enabled,
    recovered_steps,
    restore_control_state,
)
from areal_libra.metrics import StepMetrics
from areal_libra.rollout.emulated_host import EmulatedHostBackend
from areal_libra.rollout.emulation import ClusterEmulation, PacedProcessBackend, install_train_pacing
from areal_libra.rollout.fleet import build_fleet
from areal_libra.rollout.pressure import PressureSampler
from areal_libra.rollout.revive import ServerReviver, rollout_counters
from areal_libra.rollout.router import GROUPS_FILE, build_router, publish_metrics, read_groups_file
from areal_libra.stack_sampler import ENV as SAMPLER_ENV
from areal_libra.stack_sampler import StackSampler
from areal_libra.utils import first_line


def build_dataset(libra: LibraConfig | Any, areal_cfg: Any) -> Any:
    from areal.utils.dynamic_import import import_from_string

    ds = libra_config(libra).dataset
    path = areal_cfg.train_dataset.path
    path = None if path in (None, "", "generated") else str(path)
    return import_from_string(ds.builder)(path, size=ds.n_problems, seed=ds.seed, max_rows=ds.max_rows)


def routing_policy(libra: LibraConfig) -> str:
    """The request routing policy: libra mode routes with C-MLFQ where the config says AReaL's round-robin."""
    policy = libra.scheduler.policy
    if libra.mode == "libra" and policy == "round_robin":
        return "cmlfq"
    return policy


def install_router(trainer, libra: LibraConfig, run_dir: Path, metrics, force: bool = False) -> object | None:
    """Hook the project's dispatcher into AReaL's request path unless the policy is plain round-robin
    (`force`: even then, e.g. for elastic hybrids, whose servers come and go through the router)."""
    policy = routing_policy(libra)
    if policy == "round_robin" and not force:
        return None
    if libra.scheduler.policy != policy:
        libra = replace(libra, scheduler=replace(libra.scheduler, policy=policy))

    router = build_router(libra, run_dir)
    trainer.rollout.set_request_router(router)
    metrics.add_source(router.step_metrics)
    return router


def rollout_pressure(trainer, libra: LibraConfig):
    """The run's one rollout-pressure sampler (rollout/pressure.py) over AReaL's serving addresses, for the
    elastic pool and the controller; None when neither runs (static mode, no pool) or there is no engine."""
    if not _rank0():
        return None
    if libra.mode != "libra" and not libra.elastic.enabled:
        return None
    rollout = getattr(trainer, "rollout", None)
    inference = getattr(rollout, "_engine", rollout)  # RemoteSGLangEngine wraps the RemoteInfEngine
    if not hasattr(inference, "addresses"):
        return None

    return PressureSampler(lambda: list(inference.addresses))


def _rank0() -> bool:
    """This trainer process is rank 0 (the one that runs the controller, the fleet and the pool)."""
    return int(os.environ.get("RANK", "0") or 0) == 0


def _libra_rank0(libra: LibraConfig) -> bool:
    return libra.mode == "libra" and _rank0()


def install_fleet(trainer, libra: LibraConfig, run_dir: Path, metrics, router):
    """The rollout fleet (rollout/fleet.py), the one owner of rollout membership: in libra mode it switches
    layouts and replaces dead servers; elastic hybrids that serve attach and detach through it."""

    if router is None or not _rank0():
        return None
    libra_mode = _libra_rank0(libra)  # libra mode always routes (C-MLFQ), so the fleet can switch layouts
    if not (libra_mode or hybrids_serve(libra)):
        return None

    backend = None  # None: build_fleet's choice (an emulated host the launch started, else local processes)
    if os.environ.get("AREAL_LIBRA_RAY_ADDRESS"):  # cluster=ray / ray_local: servers are Ray actors
        from areal_libra.ray.backend import RayBackend

        backend = RayBackend.from_env(str(run_dir))
    elif not libra.emulated.host and (emu := ClusterEmulation.from_libra(libra)) is not None:
        backend = PacedProcessBackend(emu)  # cluster=emulated: new servers paced like the launcher's
    fleet = build_fleet(trainer, router, run_dir, backend=backend)
    if libra_mode and libra.revive_servers:  # a dead server is replaced (rollout/revive.py)

        reviver = ServerReviver(fleet, router, run_dir).start()
        metrics.add_source(reviver.metrics)
        trainer._libra_reviver = reviver  # stopped in main() before the router closes
    return fleet


def install_control(trainer, libra: LibraConfig, config, run_dir: Path, metrics, router, elastic, sinks: list,
                    fleet=None, pressure=None, pool_factory=None):
    """libra mode: the shared LibraController drives this run (areal_libra.live.live_cluster); `fleet`
    (install_fleet) switches its layouts; `pressure`: the run's sampler; with an elastic pool the pool's step
    observation carries its window instead."""
    if not _libra_rank0(libra):
        return None

    groups = read_groups_file(run_dir / GROUPS_FILE)[0] if (run_dir / GROUPS_FILE).exists() else []
    ctl_cfg = run_control_config(libra.control, config)  # its history covers the batches in flight
    cluster = LiveCluster(fleet, elastic, history_len=ctl_cfg.history,
                          max_running=groups[0].max_running if groups else 256,
                          max_tokens=int(config.gconfig.max_tokens), groups=groups)
    sinks.append(cluster.on_trajectory)

    state_file = ControlStateFile(run_dir)
    snap = None
    if recover_enabled(config):
        restore_control_state(run_dir, cluster)  # the planner's length history before the restart
        resume_at = recovered_steps(config)
        if resume_at is not None:  # the controller and pool at the checkpoint's step
            snap = state_file.load(resume_at)
    # One reader per window: with a pool, its observation (LiveCluster prefers it) took the step's window.
    pressure_fn = pressure.take if pressure is not None and elastic is None else None
    script = None
    if elastic is not None and libra.elastic.join_at_step is not None:  # the fixed join/release script
        script = ScheduledPolicy(libra.elastic.join_at_step, libra.elastic.release_after,
                                 libra.control.elastic_policy)
    src = plan_source(libra, config, str(config.actor.path))
    if router is not None and hasattr(router, "set_pricing"):  # C-MLFQ prices moves on the planner's spec
        router.set_pricing(src.cluster.hardware, src.model)
    control = LiveControl(ctl_cfg, src, cluster,
                          fleet=fleet, elastic_policy=script, pool_factory=pool_factory,
                          profile_steps=libra.control.profile_steps, pressure_fn=pressure_fn,
                          events_path=run_dir / "control_events.jsonl")
    if pressure is not None and hasattr(pressure, "waiting"):  # the servers' queue, in batches (a move's prediction)
        per_step = trajectories_per_step(config)
        control.backlog_fn = lambda: pressure.waiting() / per_step
    if libra.emulated.enabled and libra.emulated.profile_planner:  # the pass also times a training step
        batch = trajectories_per_step(config)

        def train_fit(prof) -> None:
            if fit_profiled_training(src, libra.emulated, prof, batch) and router is not None and hasattr(
                    router, "set_pricing"):
                router.set_pricing(src.cluster.hardware, src.model)  # C-MLFQ on the re-fitted spec too

        control.train_fit = train_fit
    if snap is not None:
        control.resume = snap
        if snap.get("pool") is not None:
            resume_pool(control, elastic, snap)

    def hook(step: int, rec: dict) -> dict:
        # AReaL's stats hook: nothing raised here may end the run (on_step records its own failures; the
        # state file and W&B are the rest). The layout in force keeps serving either way.
        try:
            out = control.on_step(step, rec)
            if recover_enabled(config):
                state_file.save(step, cluster, control)
            publish_metrics(out)  # W&B, next to AReaL's own stats
        except Exception as e:  # noqa: BLE001
            control._record({"step": step, "event": "control_failed", "detail": f"{type(e).__name__}: {e}"})
            out = {}
        return out | {"plan/allocation": control.allocation()}

    metrics.add_step_hook(hook)
    return control


def profile_rollout(rollout: Any, rows: list, staleness: Any, version: int, **kwargs: Any) -> None:
    """Play `rows` through `rollout.rollout_batch` in chunks AReaL's staleness budget admits at once. Its executor
    admits (max_head_offpolicyness + 1) x consumer_batch_size groups before a version bump, and no training step
    runs during the pass: a pass larger than that waited forever for capacity (profile_groups 16 against 2 x 4 in
    `python -m evaluation.live_elastic`). After each chunk, as after the whole pass, the budget is set back to
    version `version`'s (the pass is no step's batch). `staleness`: the executor's StalenessManager (None: one
    batch)."""
    chunk = max(1, int(staleness.get_pending_limit())) if staleness is not None else max(1, len(rows))
    for i in range(0, len(rows), chunk):
        rollout.rollout_batch(rows[i:i + chunk], **kwargs)
        if staleness is not None:
            staleness.on_version_recovered(version)


def profile_pass(trainer, libra: LibraConfig, config, dataset, wf_module, wf_cls, workflow_kwargs: dict,
                 control, router, fanout) -> ProfilePass | None:
    """The profiling pass before step 1 (control.profile, the simulator's procedure): `libra.control.profile_groups`
    prompts of the dataset, each a group of gconfig.n_samples, played by the run's workflow through AReaL's rollout
    path (`rollout_batch`, in chunks AReaL's staleness budget admits: `profile_rollout`; each returns when every
    group of it finished, the tail included) on the launch layout at the
    initial weights; their trajectories go to a ProfilePass (and the router's live tree, as the simulator fits
    C-MLFQ on its profile), not to the step metrics, and the controller starts from the first plan solved on
    all of them. The pass leaves AReaL's staleness budget as it found it (accepted reset to version 0's).
    None when there is no controller or no pass (profile_groups 0); a pass that fails is one control_failed
    line, and the first plan then comes from the first steps (profile_steps)."""
    n = int(libra.control.profile_groups)
    if control is None or n <= 0 or control.resume is not None:
        return None
    group = int(config.gconfig.n_samples)
    prof = ProfilePass(n, group)

    def sink(traj) -> None:
        prof.add(traj)
        if router is not None:
            router.on_trajectory(traj)

    rows = [dataset[i % len(dataset)] for i in range(n)]
    kwargs = dict(workflow_kwargs)
    if hasattr(wf_cls, "profile_kwargs"):  # a workflow that draws its episodes (the emulated one): the profile's
        kwargs.update(wf_cls.profile_kwargs(n))
    t0 = time.monotonic()
    if hasattr(wf_module, "set_trajectory_sink"):
        wf_module.set_trajectory_sink(sink)
    try:
        inner = getattr(trainer.rollout, "_engine", trainer.rollout)
        sm = getattr(getattr(inner, "workflow_executor", None), "staleness_manager", None)
        profile_rollout(trainer.rollout, rows, sm, int(trainer.actor.get_version()), workflow=libra.workflow,
                        workflow_kwargs=kwargs, group_size=group)
        if hasattr(router, "learn_finished"):  # C-MLFQ starts from the profile, as the simulator's
            router.learn_finished()
        print(f"areal_libra control: profiling pass: {prof.summary()} in {time.monotonic() - t0:.1f} s", flush=True)
        control.start_from_profile(prof, step=0)
    except Exception as e:  # noqa: BLE001 - the run goes on; its first plan then comes from the first steps
        control._record({"step": 0, "event": "control_failed", "detail": (
            f"profiling pass: {type(e).__name__}: {first_line(e)}; the first plan comes from the first "
            f"{libra.control.profile_steps} step(s)")})
    finally:
        if hasattr(wf_module, "set_trajectory_sink"):
            wf_module.set_trajectory_sink(fanout)
    return prof


def resume_pool(control, elastic, snap: dict) -> None:
    """The elastic pool's saved state: hybrids that were training re-join (LiveElastic.resume); logged in
    control_events.jsonl either way."""
    step = int(snap["step"])
    if elastic is None:
        control._record({"step": step, "event": "elastic_resume", "detail": "saved pool state ignored: "
                         "libra.elastic is off in this run"})
        return
    try:
        rids = elastic.resume(snap["pool"])
    except ValueError as e:
        print(f"areal_libra recover: pool state not restored ({e}); hybrids start in rollout", flush=True)
        return
    detail = (f"{', '.join(rids)} training at step {step}: re-join through the join protocol once the "
              "restarted worker is ready") if rids else f"no hybrid was training at step {step}"
    control._record({"step": step, "event": "elastic_resume", "detail": detail})


def install_emulation(trainer, libra: LibraConfig, run_dir: Path, metrics, control, elastic=None) -> None:
    """cluster=emulated: pace the trainer (servers pace themselves) to the emulated model and accelerators."""

    emu = ClusterEmulation.from_libra(libra)
    if emu is None:
        return

    static_groups = read_groups_file(run_dir / GROUPS_FILE)[0]
    if control is not None:
        control.cluster.emulation = emu
    groups_fn = (lambda: control.cluster.groups) if control is not None else (lambda: static_groups)
    def hybrids_fn() -> int:  # the pool built at launch, or the one sized with the first plan
        pool = elastic if elastic is not None else getattr(getattr(control, "cluster", None), "elastic", None)
        return int(pool.training_hybrids()) if pool is not None else 0

    if elastic is not None:  # the pool sees the trainer's core in emulated accelerators (hybrid units)
        elastic.pool.core_fn = lambda: emu.check_layout(groups_fn())[1]
    host = EmulatedHostBackend.from_run_dir(run_dir)  # libra.emulated.host: its pacing error too
    if control is not None and host is not None:  # the rollout busy share each step (StepObservation.rollout_busy)
        control.busy_fn = host.pacing
    try:  # the dispatcher's waits for results tell the wait for rollout from the trainer's own work
        found = lag_bound.dispatcher_of(getattr(trainer, "rollout", None))
    except RuntimeError:  # not initialised
        found = None
    install_train_pacing(trainer, emu, groups_fn, metrics, version_fn=lambda: trainer.actor.get_version(),
                         hybrids_fn=hybrids_fn, host_pacing_fn=None if host is None else host.pacing,
                         train_sample=int(libra.emulated.train_sample),
                         dispatcher=found[0] if found is not None else None,
                         rollout=getattr(trainer, "rollout", None))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    args = ap.parse_args(argv)
    run_dir = Path(args.run_dir)

    from areal import PPOTrainer
    from areal.api.cli_args import GRPOConfig, load_expr_config


    # AReaL's logging set-up (dictConfig) disables loggers created before it: keep ours.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("areal_libra"):
            logging.getLogger(name).disabled = False

    # A diagnostic for a trainer that hangs: `kill -USR1 <pid>` writes every thread's stack to the trainer log.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # A diagnostic: where the trainer's time goes, every thread's stack sampled (areal_libra/stack_sampler.py).
    sampler = StackSampler(os.environ[SAMPLER_ENV]).start() if os.environ.get(SAMPLER_ENV) else None
    config, _ = load_expr_config(["--config", str(run_dir / "areal_config.yaml")], GRPOConfig)
    libra = load_run_config(run_dir)  # the typed config the launch validated
    dataset = build_dataset(libra, config)

    metrics = StepMetrics(run_dir / "metrics.jsonl", total_steps=config.total_train_steps)
    workflow_mod, _, _ = libra.workflow.rpartition(".")
    wf_module = importlib.import_module(workflow_mod)
    # Fan-out: finished trajectories go to the metrics and, once installed, to the router's live tree.
    sinks = [metrics.on_trajectory]

    def fanout(traj) -> None:
        for sink in sinks:
            sink(traj)

    if hasattr(wf_module, "set_trajectory_sink"):
        wf_module.set_trajectory_sink(fanout)

    workflow_kwargs = dict(
        gconfig=config.gconfig,
        tokenizer_path=config.tokenizer_path,
        max_turns=libra.max_turns,
    )
    wf_cls = getattr(wf_module, libra.workflow.rpartition(".")[2])
    if hasattr(wf_cls, "libra_kwargs"):  # a workflow's own settings from the libra: config (e.g. its tool's URL)
        workflow_kwargs.update(wf_cls.libra_kwargs(libra))
    with PPOTrainer(config, train_dataset=dataset, valid_dataset=None) as trainer:
        trainer.stats_logger.add_sink(metrics.on_commit)

        router = install_router(trainer, libra, run_dir, metrics, force=hybrids_serve(libra))
        if router is not None:
            sinks.append(router.on_trajectory)
            router.attach_engine(trainer.rollout)  # a server that missed a weight update stays out
        if lag_bounded(libra):
            lag_bound.install(trainer.rollout)  # no group trained more than eta versions after it started

        pressure = rollout_pressure(trainer, libra)
        if router is not None and pressure is not None and libra.mode == "libra" and libra.working_set_admission:
            gate = admission.install(trainer.rollout, router, pressure)  # no new group while the KV is full
            if gate is not None:
                metrics.add_source(gate.metrics)
        fleet = install_fleet(trainer, libra, run_dir, metrics, router)  # None: no layout changes, no hybrids
        if fleet is not None and pressure is not None:
            pressure.lent = fleet.hybrid_addresses  # the admission counts the KV of the servers that stay
        follower = None
        if router is not None and not _rank0() and libra.mode == "libra":  # a multi-rank trainer (cluster=ray*)
            follower = LayoutFollower(trainer.rollout, router, run_dir).start()  # rank 0's fleet's layout
        elastic = install_elastic(trainer, libra, run_dir, metrics, fleet, pressure)  # None unless libra.elastic.enabled
        pool_factory = plan_pool_factory(trainer, libra, run_dir, metrics, fleet, pressure)  # size_with_plan
        control = install_control(trainer, libra, config, run_dir, metrics, router, elastic, sinks, fleet, pressure,
                                  pool_factory)
        install_emulation(trainer, libra, run_dir, metrics, control, elastic)
        if profile_pass(trainer, libra, config, dataset, wf_module, wf_cls, workflow_kwargs, control, router,
                        fanout) is not None:
            metrics.start_clock()  # step 1's time leaves the pass out (the controller's measured step time)

        metrics.add_source(lambda: rollout_counters(trainer.rollout))  # nothing lost: accepted vs rejected
        try:
            trainer.train(workflow=libra.workflow, workflow_kwargs=workflow_kwargs)
        finally:
            if getattr(trainer, "_libra_reviver", None) is not None:
                trainer._libra_reviver.stop()
            if follower is not None:
                follower.stop()
                follower.write_counters(rollout_counters(trainer.rollout))  # this rank's accepted/rejected
            if control is not None:
                control.close(run_dir / "allocation.png")
                elastic = elastic or control.cluster.elastic  # a pool sized with the plan
            if elastic is not None:
                elastic.close()
            if fleet is not None:
                fleet.close()  # (again: idempotent) a run without the controller closes it here
            if router is not None and hasattr(router, "close"):
                router.close()
            if pressure is not None:
                pressure.close()
            if sampler is not None:
                sampler.stop()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("AREAL_SPMD_MODE", "1")
    sys.exit(main())
