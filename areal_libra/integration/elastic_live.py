"""Elastic Hybrid Pool in a live AReaL run (SPMD trainer, FSDP engine, fsdp:d1 on the CPU cluster).

The trainer calls, once the PPOTrainer exists:

    elastic = install_elastic(trainer, libra, run_dir, metrics)   # None when not enabled
    ...
    finally:
        if elastic is not None:
            elastic.close()

Configuration: `libra.elastic` (or, while the config tree has no such group, the JSON in the environment
variable AREAL_LIBRA_ELASTIC), fields of `LiveElasticConfig`, e.g.
`{"enabled": true, "hybrids": 1, "join_at_step": 2, "release_after": 3}`.

What it does: starts a TCPStore (loopback) and `hybrids` worker processes (`areal_worker`, each its own
FSDPEngine built from the run's AReaL config), installs the FSDP hook on the actor engine (domain
reduction, batch sharing, snapshots), and before each training step asks the policy — fed with the
measured train time and the rest of the iteration as rollout time — or the fixed schedule
(`join_at_step` / `release_after`, for demonstrations) whether to join or release. Per-step `elastic/*`
keys go to metrics.jsonl through `metrics.add_source`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from areal_libra.config import LiveElasticConfig
from areal_libra.elastic.policy import ElasticConfig, ElasticPolicy
from areal_libra.elastic.state import ReplicaState
from areal_libra.elastic_runtime.controller import ElasticController
from areal_libra.elastic_runtime.core import ElasticCore, RuntimeConfig
from areal_libra.integration.elastic_hook import FSDPElasticHook


def load_config(libra: Any) -> LiveElasticConfig:
    raw: Any = None
    try:
        raw = libra.get("elastic") if libra is not None else None
    except Exception:  # noqa: BLE001 - a struct config without the key
        raw = None
    if raw is None and os.environ.get("AREAL_LIBRA_ELASTIC"):
        raw = json.loads(os.environ["AREAL_LIBRA_ELASTIC"])
    if raw is None:
        return LiveElasticConfig()
    if not isinstance(raw, dict):
        from omegaconf import OmegaConf

        raw = OmegaConf.to_container(raw, resolve=True)
    unknown = set(raw) - set(LiveElasticConfig.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown libra.elastic keys: {sorted(unknown)}")
    return LiveElasticConfig(**raw)


class LiveElastic:
    def __init__(self, engine: Any, run_dir: Path, cfg: LiveElasticConfig) -> None:
        import torch.distributed as dist

        if int(engine.data_parallel_world_size) != 1:
            raise ValueError("the live elastic pool supports a single-rank core (fsdp:d1) for now")
        self.cfg = cfg
        self.dir = run_dir / "elastic"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        rt = RuntimeConfig(**cfg.runtime)
        self.rids = [f"h{i}" for i in range(cfg.hybrids)]
        self.core = ElasticCore(self.store, rt, 0, 1, None, str(self.dir / "snapshots"), state_fn=dict,
                                hybrids=[(rid, 1) for rid in self.rids])
        self.hook = FSDPElasticHook.install(engine, self.core)
        self.hook.before_step = self._before_step
        self.controller = ElasticController(self.core, ElasticPolicy(ElasticConfig(**cfg.policy)))
        self.procs: list[subprocess.Popen] = []
        env = dict(os.environ)
        # Workers block on store keys in 2 s slices; c10d logs a warning per slice otherwise.
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        for rid in self.rids:
            log = open(self.dir / f"{rid}.log", "w")  # noqa: SIM115 - lives as long as the worker
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "areal_libra.integration.elastic_worker", "--store", f"127.0.0.1:{self.store.port}",
                 "--rid", rid, "--snapshot-dir", str(self.dir / "snapshots"),
                 "--config", str(run_dir / "areal_config.yaml")],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        self.first_real: dict[str, int] = {}
        self.t_train = 0.0
        self.t_iter_start: float | None = None
        self.last_decision = ""
        (self.dir / "config.json").write_text(json.dumps(asdict(cfg)))

    def _ready(self, rid: str) -> bool:
        return self.core.kv.has(f"hb/{rid}/0")

    def _before_step(self, step: int, t_train_s: float) -> None:
        now = time.monotonic()
        t_iter = now - self.t_iter_start if self.t_iter_start is not None else None
        self.t_iter_start = now
        for ev in self.core.events:
            if ev["event"] == "first_real_gradient":
                self.first_real.setdefault(ev["rid"], ev["step"])
        c = self.cfg
        if c.join_at_step is not None:
            for rid in self.rids:
                h = self.core.pool.hybrid[rid]
                if step >= c.join_at_step and h.generation == 0 and self._ready(rid):
                    self.core.request_join(rid)
                if (c.release_after is not None and rid in self.first_real and h.state == ReplicaState.TRAINING
                        and step >= self.first_real[rid] + c.release_after):
                    self.core.request_release(rid)
            return
        if t_iter is None:
            return
        # The asynchronous loop's iteration = train time + time waiting for rollout output.
        t_rollout = max(t_iter - t_train_s, 1e-6)
        d = self.controller.on_step(t_train_s, t_rollout, 0.0)
        self.last_decision = f"{d.action}:{d.reason}"

    def step_metrics(self) -> dict[str, float]:
        out = self.hook.step_metrics()
        out["elastic/hybrid_processes_alive"] = float(sum(p.poll() is None for p in self.procs))
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


def install_elastic(trainer: Any, libra: Any, run_dir: Path, metrics: Any) -> LiveElastic | None:
    cfg = load_config(libra)
    if not cfg.enabled:
        return None
    live = LiveElastic(trainer.actor, Path(run_dir), cfg)
    metrics.add_source(live.step_metrics)
    return live
