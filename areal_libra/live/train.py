"""Trainer process: AReaL's PPOTrainer (GRPO) with this project's workflow, metrics and routing.

Started by `areal_libra.launch` in AReaL's SPMD mode (AREAL_SPMD_MODE=1, torch.distributed env set,
AREAL_LLM_SERVER_ADDRS naming the rollout servers):

    python -m areal_libra.live.train --run-dir DIR
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from pathlib import Path

from omegaconf import OmegaConf


def build_dataset(libra, areal_cfg):
    from areal.utils.dynamic_import import import_from_string

    path = areal_cfg.train_dataset.path
    path = None if path in (None, "", "generated") else str(path)
    builder = import_from_string(str(libra.dataset.get("builder", "areal_libra.workflows.math_data.load_math_dataset")))
    max_rows = libra.dataset.get("max_rows")
    return builder(path, size=int(libra.dataset.n_problems), seed=int(libra.dataset.seed),
                   max_rows=None if max_rows is None else int(max_rows))


def routing_policy(libra) -> str:
    """The request routing policy: libra mode routes with C-MLFQ where the config says AReaL's round-robin."""
    policy = str(libra.get("scheduler", {}).get("policy", "round_robin"))
    if str(libra.get("mode", "static")) == "libra" and policy == "round_robin":
        return "cmlfq"
    return policy


def install_router(trainer, libra, run_dir: Path, metrics, force: bool = False) -> object | None:
    """Hook the project's dispatcher into AReaL's request path unless the policy is plain round-robin
    (`force`: even then, e.g. for elastic hybrids, whose servers come and go through the router)."""
    policy = routing_policy(libra)
    if policy == "round_robin" and not force:
        return None
    if str(libra.get("scheduler", {}).get("policy")) != policy:
        libra = OmegaConf.merge(libra, {"scheduler": {"policy": policy}})
    from areal_libra.rollout.router import build_router

    router = build_router(libra, run_dir)
    trainer.rollout.set_request_router(router)
    metrics.add_source(router.step_metrics)
    return router


def rollout_pressure(trainer, libra):
    """The run's one rollout-pressure sampler (rollout/pressure.py) over AReaL's serving addresses, for the
    elastic pool and the controller; None when neither runs (static mode, no pool) or there is no engine."""
    from areal_libra.live.elastic_live import load_config

    if int(os.environ.get("RANK", "0") or 0) != 0:
        return None
    if str(libra.get("mode", "static")) != "libra" and not load_config(libra).enabled:
        return None
    rollout = getattr(trainer, "rollout", None)
    inference = getattr(rollout, "_engine", rollout)  # RemoteSGLangEngine wraps the RemoteInfEngine
    if not hasattr(inference, "addresses"):
        return None
    from areal_libra.rollout.pressure import PressureSampler

    return PressureSampler(lambda: list(inference.addresses))


def install_control(trainer, libra, config, run_dir: Path, metrics, router, elastic, sinks: list, pressure=None):
    """libra mode: the shared LibraController drives this run (areal_libra.live.live_cluster). `pressure`:
    the run's sampler; with an elastic pool the pool's step observation carries its window instead."""
    if str(libra.get("mode", "static")) != "libra" or int(os.environ.get("RANK", "0") or 0) != 0:
        return None
    from areal_libra.config import libra_config
    from areal_libra.live.live_cluster import LiveCluster, LiveControl, control_config, plan_source
    from areal_libra.rollout.router import GROUPS_FILE, publish_metrics, read_groups_file

    typed = libra_config(libra)
    fleet = None
    if router is not None:  # libra mode always routes (C-MLFQ), so the fleet can switch layouts
        from areal_libra.rollout.fleet import build_fleet

        fleet = build_fleet(trainer, router, run_dir)
        if bool(libra.get("revive_servers", True)):  # a dead server is replaced (rollout/revive.py)
            from areal_libra.rollout.revive import ServerReviver

            reviver = ServerReviver(fleet, router, run_dir).start()
            metrics.add_source(reviver.metrics)
            trainer._libra_reviver = reviver  # stopped in main() before the router closes
    groups = read_groups_file(run_dir / GROUPS_FILE)[0] if (run_dir / GROUPS_FILE).exists() else []
    cluster = LiveCluster(fleet, elastic, history_len=typed.control.history,
                          max_running=groups[0].max_running if groups else 256,
                          max_tokens=int(config.gconfig.max_tokens), groups=groups)
    sinks.append(cluster.on_trajectory)
    from areal_libra.live.recover import (
        ControlStateFile,
        recover_enabled,
        recovered_steps,
        restore_control_state,
    )

    state_file = ControlStateFile(run_dir)
    snap = None
    if recover_enabled(config):
        restore_control_state(run_dir, cluster)  # the planner's length history before the restart
        resume_at = recovered_steps(config)
        if resume_at is not None:  # the controller and pool at the checkpoint's step
            snap = state_file.load(resume_at)
    # One reader per window: with a pool, its observation (LiveCluster prefers it) took the step's window.
    pressure_fn = pressure.take if pressure is not None and elastic is None else None
    control = LiveControl(control_config(typed), plan_source(libra, config, str(config.actor.path)), cluster,
                          fleet=fleet,
                          profile_steps=typed.control.profile_steps, pressure_fn=pressure_fn,
                          events_path=run_dir / "control_events.jsonl")
    if snap is not None:
        control.resume = snap
        if snap.get("pool") is not None:
            resume_pool(control, elastic, snap)

    def hook(step: int, rec: dict) -> dict:
        out = control.on_step(step, rec)
        if recover_enabled(config):
            state_file.save(step, cluster, control)
        publish_metrics(out)  # W&B, next to AReaL's own stats
        return out | {"plan/allocation": control.allocation()}

    metrics.add_step_hook(hook)
    return control


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


def install_emulation(trainer, libra, run_dir: Path, metrics, control, elastic=None) -> None:
    """cluster=emulated: pace the trainer (servers pace themselves) to the emulated model and accelerators."""
    from areal_libra.rollout.emulation import ClusterEmulation

    emu = ClusterEmulation.from_libra(libra)
    if emu is None:
        return
    from areal_libra.rollout.emulation import install_train_pacing
    from areal_libra.rollout.router import GROUPS_FILE, read_groups_file

    static_groups = read_groups_file(run_dir / GROUPS_FILE)[0]
    if control is not None:
        control.cluster.emulation = emu
    groups_fn = (lambda: control.cluster.groups) if control is not None else (lambda: static_groups)
    hybrids_fn = elastic.training_hybrids if elastic is not None else (lambda: 0)
    if elastic is not None:  # the pool sees the trainer's core in emulated accelerators (hybrid units)
        elastic.pool.core_fn = lambda: emu.check_layout(groups_fn())[1]
    install_train_pacing(trainer, emu, groups_fn, metrics, version_fn=lambda: trainer.actor.get_version(),
                         hybrids_fn=hybrids_fn)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    args = ap.parse_args(argv)
    run_dir = Path(args.run_dir)

    from areal import PPOTrainer
    from areal.api.cli_args import GRPOConfig, load_expr_config

    from areal_libra.metrics import StepMetrics

    # AReaL's logging set-up (dictConfig) disables loggers created before it: keep ours.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("areal_libra"):
            logging.getLogger(name).disabled = False

    config, _ = load_expr_config(["--config", str(run_dir / "areal_config.yaml")], GRPOConfig)
    libra = OmegaConf.load(run_dir / "libra_config.yaml")
    dataset = build_dataset(libra, config)

    metrics = StepMetrics(run_dir / "metrics.jsonl", total_steps=config.total_train_steps)
    workflow_mod, _, _ = str(libra.workflow).rpartition(".")
    wf_module = importlib.import_module(workflow_mod)
    # Fan-out: finished trajectories go to the metrics and, once installed, to the router's live tree.
    sinks = [metrics.on_trajectory]
    if hasattr(wf_module, "set_trajectory_sink"):
        wf_module.set_trajectory_sink(lambda traj: [sink(traj) for sink in sinks])

    workflow_kwargs = dict(
        gconfig=config.gconfig,
        tokenizer_path=config.tokenizer_path,
        max_turns=int(libra.max_turns),
    )
    wf_cls = getattr(wf_module, str(libra.workflow).rpartition(".")[2])
    if hasattr(wf_cls, "libra_kwargs"):  # a workflow's own settings from the libra: config (e.g. its tool's URL)
        workflow_kwargs.update(wf_cls.libra_kwargs(libra))
    with PPOTrainer(config, train_dataset=dataset, valid_dataset=None) as trainer:
        trainer.stats_logger.add_sink(metrics.on_commit)
        from areal_libra.live.elastic_live import hybrids_serve

        router = install_router(trainer, libra, run_dir, metrics, force=hybrids_serve(libra))
        if router is not None:
            sinks.append(router.on_trajectory)
            router.attach_engine(trainer.rollout)  # a server that missed a weight update stays out
        from areal_libra.live.elastic_live import install_elastic

        pressure = rollout_pressure(trainer, libra)
        elastic = install_elastic(trainer, libra, run_dir, metrics, pressure)  # None unless libra.elastic.enabled
        control = install_control(trainer, libra, config, run_dir, metrics, router, elastic, sinks, pressure)
        install_emulation(trainer, libra, run_dir, metrics, control, elastic)
        from areal_libra.rollout.revive import rollout_counters

        metrics.add_source(lambda: rollout_counters(trainer.rollout))  # nothing lost: accepted vs rejected
        try:
            trainer.train(workflow=str(libra.workflow), workflow_kwargs=workflow_kwargs)
        finally:
            if getattr(trainer, "_libra_reviver", None) is not None:
                trainer._libra_reviver.stop()
            if control is not None:
                control.close(run_dir / "allocation.png")
            if elastic is not None:
                elastic.close()
            if router is not None and hasattr(router, "close"):
                router.close()
            if pressure is not None:
                pressure.close()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("AREAL_SPMD_MODE", "1")
    sys.exit(main())
