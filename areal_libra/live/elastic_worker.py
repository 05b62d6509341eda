"""A hybrid replica process for a live AReaL run (SPMD, FSDP engine):

    python -m areal_libra.live.elastic_worker --store HOST:PORT --rid h0 --snapshot-dir DIR \\
        --config RUN_DIR/areal_config.yaml [--rank 0]

Builds the actor's FSDPEngine from the run's AReaL config (its own single-rank torch.distributed world)
and runs `HybridWorker` with `AReaLEngineReplica`: it joins when the core's leader asks, trains on the
batch shards the core's hook hands it, and leaves on release. With `--serve` it serves rollout while in
rollout: `modeswitch.HttpRollout` with an embedded server on its own current weights inside this process,
registered with the trainer's router and drained on join (elastic_serving.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from areal_libra.elastic_runtime.core import RuntimeConfig
from areal_libra.elastic_runtime.hybrid import HybridWorker
from areal_libra.elastic_runtime.kv import KV, connect
from areal_libra.elastic_runtime.modeswitch import HttpRollout
from areal_libra.live.elastic_hook import AReaLEngineReplica
from areal_libra.live.elastic_serving import inprocess_launch, serve_channel
from areal_libra.rollout.emulated_host import EmulatedHostBackend
from areal_libra.rollout.emulation import ServerPacing
from areal_libra.rollout.launcher import ServerSpec
from areal_libra.utils import free_port


def build_engine(engine_config: Any, dataset_size: int = 1024, batch_size: int = 16) -> Any:
    """An initialised FSDPEngine in a fresh single-rank world (the hybrid's own process group)."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    from areal.api.io_struct import FinetuneSpec
    from areal.engine.fsdp_engine import FSDPEngine

    engine = FSDPEngine(engine_config)
    engine.create_process_group()
    engine.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=dataset_size,
                                         train_batch_size=batch_size))
    return engine


def emulated_launch(backend: EmulatedHostBackend, tp: int, max_running: int, rid: str) -> Any:
    """`launch(replica)` for HttpRollout on an emulated host: one emulated server of TP `tp` inside the host
    (no weights to save: it runs no model; the next weight update reaches it through the fleet)."""

    def launch(replica: Any) -> tuple[str, Any]:
        (h,) = backend.start("", [ServerSpec(tp=tp, max_running=max_running, group=f"hybrid-{rid}")], "")
        return f"http://{h.addr}", lambda: backend.stop(h)

    return launch


class AfterFirstJoin:
    """A hybrid's rollout side that starts in training: the worker's first start (before any join) serves
    nothing; every start after a release serves."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.started = inner, False

    def start(self, replica: Any) -> None:
        if not self.started:
            self.started = True
            return
        self.inner.start(replica)

    def drain(self) -> list[Any]:
        return self.inner.drain()


def run_worker(host: str, port: int, rid: str, rank: int, snapshot_dir: str, engine: Any,
               rollout: Any = None, cfg: Any = None) -> dict[str, Any]:

    replica = AReaLEngineReplica(engine, snapshot_dir, rid, rank)
    return HybridWorker(host, port, cfg or RuntimeConfig(), rid, rank, snapshot_dir, replica, rollout).run()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="hybrid replica worker for a live AReaL run")
    ap.add_argument("--store", required=True, help="HOST:PORT of the elastic TCPStore")
    ap.add_argument("--rid", required=True)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--snapshot-dir", required=True)
    ap.add_argument("--config", required=True, help="the run's AReaL config (areal_config.yaml)")
    ap.add_argument("--serve", action="store_true", help="serve rollout requests while in rollout")
    ap.add_argument("--server-threads", type=int, default=1)
    ap.add_argument("--server-max-running", type=int, default=64)
    ap.add_argument("--ack-timeout", type=float, default=30.0)
    ap.add_argument("--pacing", default=None,
                    help="the served server's pacing as JSON, ServerPacing fields (an emulated cluster)")
    ap.add_argument("--emulated-host-tp", type=int, default=None,
                    help="serve as one emulated server of this TP inside the run's emulated host (rollout.emulated_host)")
    ap.add_argument("--serve-after-join", action="store_true",
                    help="start in training: serve rollout only after the first release")
    ap.add_argument("--runtime", default="{}", help="RuntimeConfig fields as JSON (the trainer's)")
    args = ap.parse_args(argv)
    host, _, port = args.store.rpartition(":")
    if not host or not port.isdigit():
        print(f"areal_worker: --store must be HOST:PORT, got {args.store!r}", file=sys.stderr)
        return 2
    if not os.path.exists(args.config):
        print(f"areal_worker: --config {args.config}: no such file", file=sys.stderr)
        return 2
    from areal.api.cli_args import GRPOConfig, load_expr_config

    config, _ = load_expr_config(["--config", args.config], GRPOConfig)

    try:
        rt = RuntimeConfig(**json.loads(args.runtime))
    except (ValueError, TypeError) as e:
        print(f"areal_worker: --runtime: {e}", file=sys.stderr)
        return 2
    pacing = None
    if args.pacing is not None:

        try:
            fields = json.loads(args.pacing)
            if not isinstance(fields, dict):
                raise ValueError("not a JSON object")
            pacing = ServerPacing(**fields)
        except (ValueError, TypeError) as e:  # EmulationError is a ValueError
            print(f"areal_worker: --pacing: {e}", file=sys.stderr)
            return 2
    engine = build_engine(config.actor, batch_size=config.train_dataset.batch_size)
    rollout = None
    if args.serve:

        register, unregister = serve_channel(KV(connect(host, int(port)), rt.namespace), args.rid,
                                             args.server_threads, args.server_max_running, args.ack_timeout)
        root = os.path.join(os.path.dirname(os.path.abspath(args.snapshot_dir)), f"serve_{args.rid}")
        if args.emulated_host_tp is not None:  # the run directory holds the config and the host's address
            backend = EmulatedHostBackend.from_run_dir(os.path.dirname(os.path.abspath(args.config)))
            if backend is None:
                print("areal_worker: --emulated-host-tp: the run has no emulated host", file=sys.stderr)
                return 2
            launch = emulated_launch(backend, args.emulated_host_tp, args.server_max_running, args.rid)
        else:
            launch = inprocess_launch(engine, root, args.server_threads, args.server_max_running, pacing=pacing)
        rollout = HttpRollout(launch, register, unregister, ready_timeout_s=120.0)
        if args.serve_after_join:
            rollout = AfterFirstJoin(rollout)
    run_worker(host, int(port), args.rid, args.rank, args.snapshot_dir, engine, rollout=rollout, cfg=rt)
    return 0


if __name__ == "__main__":
    sys.exit(main())
