"""Trainer process: AReaL's PPOTrainer (GRPO) with this project's workflow, metrics and routing.

Started by `areal_libra.launch` in AReaL's SPMD mode (AREAL_SPMD_MODE=1, torch.distributed env set,
AREAL_LLM_SERVER_ADDRS naming the rollout servers):

    python -m areal_libra.integration.train --run-dir DIR
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
    from areal_libra.workflows.math_data import load_math_dataset

    path = areal_cfg.train_dataset.path
    path = None if path in (None, "", "generated") else str(path)
    return load_math_dataset(path, size=int(libra.dataset.n_problems), seed=int(libra.dataset.seed))


def install_router(trainer, libra, run_dir: Path, metrics, force: bool = False) -> object | None:
    """Hook the project's dispatcher into AReaL's request path unless the policy is plain round-robin
    (`force`: even then, e.g. for elastic hybrids, whose servers come and go through the router)."""
    policy = str(libra.get("scheduler", {}).get("policy", "round_robin"))
    if policy == "round_robin" and not force:
        return None
    from areal_libra.integration.router import build_router

    router = build_router(libra, run_dir)
    trainer.rollout.set_request_router(router)
    metrics.add_source(router.step_metrics)
    return router


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
    with PPOTrainer(config, train_dataset=dataset, valid_dataset=None) as trainer:
        trainer.stats_logger.add_sink(metrics.on_commit)
        from areal_libra.integration.elastic_live import hybrids_serve

        router = install_router(trainer, libra, run_dir, metrics, force=hybrids_serve(libra))
        if router is not None:
            sinks.append(router.on_trajectory)
            router.attach_engine(trainer.rollout)  # a server that missed a weight update stays out
        from areal_libra.integration.elastic_live import install_elastic

        elastic = install_elastic(trainer, libra, run_dir, metrics)  # None unless libra.elastic.enabled
        try:
            trainer.train(workflow=str(libra.workflow), workflow_kwargs=workflow_kwargs)
        finally:
            if elastic is not None:
                elastic.close()
            if router is not None and hasattr(router, "close"):
                router.close()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("AREAL_SPMD_MODE", "1")
    sys.exit(main())
