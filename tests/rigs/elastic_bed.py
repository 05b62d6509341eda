"""Multi-process test bed: core replica ranks + hybrid replica ranks on loopback gloo.

Used by the tests and by evaluation/elastic_bench.py (one implementation). A core replica is
`replica_size` ranks with their own (never rebuilt) process group; each hybrid replica is another
`replica_size` ranks with their own internal group; all of them meet in the cross-replica domain.
Data is a deterministic function of (step, replica slot, rank), so runs can be compared bitwise.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import tempfile
import time
import traceback
import zlib
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from areal_libra.elastic.state import ReplicaState
from areal_libra.elastic_runtime import priority
from areal_libra.elastic_runtime.core import CORE, ElasticCore, RuntimeConfig
from areal_libra.elastic_runtime.hybrid import HybridWorker
from areal_libra.elastic_runtime.kv import KV, connect
from areal_libra.elastic_runtime.modeswitch import QueueRollout, push_requests
from areal_libra.elastic_runtime.replica import ModuleReplica


@dataclass
class TestbedConfig:
    __test__ = False  # not a pytest class

    max_steps: int = 12
    replica_size: int = 1
    batch_per_rank: int = 16
    hybrids: tuple[str, ...] = ("h0",)
    join_at: dict[str, int] = field(default_factory=dict)  # rid -> step at which the leader requests a join
    release_after: dict[str, int] = field(default_factory=dict)  # rid -> steps after its first real gradient
    tail_steps: int = 2  # steps after every scheduled join/release has resolved
    static: tuple[str, ...] = ()  # hybrids training from start_step on (reference runs)
    start_step: int = 0
    init_state: str | None = None  # path with "{rank}": per-position state files to start from (reference runs)
    save_state_at: int | None = None  # every core rank saves its state at this version: state_v<V>_p<rank>.pt
    model: str = "mlp"  # "mlp" | "qwen2"
    hidden: int = 64
    seed: int = 0
    lr: float = 1e-2
    step_sleep_s: float = 0.0  # emulated extra compute per core step (benchmarks)
    corrupt: list[str] = field(default_factory=list)  # successive publishes: "truncate" | "wrong_version"
    # {"rid", "state": "fetching"|"zero_sync"|"training", "signal": "SIGKILL" (default) | "SIGSTOP"}:
    # signal the replica's processes once the plan shows it in that state (SIGSTOP: hung, not dead);
    # with "resume_after_s" a SIGSTOP is a stall: SIGCONT after that long (a descheduled process)
    kill: dict[str, Any] | None = None
    rollout_requests: int = 0  # size of the rollout workload served by hybrids while in rollout mode
    pin_cpus: bool = False  # core ranks on CPU 0, hybrid ranks on the other CPUs (stand-in for own devices)
    # nice value of the background threads (snapshot/log writer, joiner's bulk catch-up). 0 here: tests
    # check the protocol, and under heavy load nice 10 work may take longer than a test's step budget;
    # the benchmark passes its --background-nice (default 10, the live default in priority.py).
    background_nice: int = 0
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    timeout_s: float = 180.0


# -- model and data ---------------------------------------------------------------------------------
def _gen(cfg: TestbedConfig, step: int, slot: str, rank: int) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(f"{cfg.seed}/{step}/{slot}/{rank}".encode()))


def build_model(cfg: TestbedConfig) -> nn.Module:
    torch.manual_seed(cfg.seed)
    if cfg.model == "mlp":
        return nn.Sequential(nn.Linear(16, cfg.hidden), nn.Tanh(), nn.Linear(cfg.hidden, cfg.hidden), nn.Tanh(),
                             nn.Linear(cfg.hidden, 4))
    if cfg.model == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        qc = Qwen2Config(vocab_size=128, hidden_size=cfg.hidden, intermediate_size=2 * cfg.hidden,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=False)
        qc._attn_implementation = "eager"
        return Qwen2ForCausalLM(qc)
    raise ValueError(f"unknown model {cfg.model!r} (mlp or qwen2)")


def make_loss(cfg: TestbedConfig, slot: str, rank: int):
    teacher = torch.Generator().manual_seed(1234)
    w_t = torch.randn(16, 4, generator=teacher)

    def loss_fn(model: nn.Module, step: int) -> tuple[torch.Tensor, float]:
        g = _gen(cfg, step, slot, rank)
        if cfg.model == "qwen2":
            ids = torch.randint(0, 128, (cfg.batch_per_rank, 16), generator=g)
            return model(input_ids=ids, labels=ids).loss, float(cfg.batch_per_rank)
        x = torch.randn(cfg.batch_per_rank, 16, generator=g)
        y = torch.tanh(x @ w_t)
        return nn.functional.mse_loss(model(x), y), float(cfg.batch_per_rank)

    return loss_fn


def build_replica(cfg: TestbedConfig, slot: str, rank: int, group: Any) -> ModuleReplica:
    model = build_model(cfg)
    # Explicit single-tensor CPU kernels: no default that consults the accelerator.
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, foreach=False, fused=False, capturable=False)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.9)
    rep = ModuleReplica(model, opt, make_loss(cfg, slot, rank), sched, group, cfg.replica_size)
    if cfg.init_state is not None:
        rep.load_state(torch.load(cfg.init_state.format(rank=rank), weights_only=False))
    return rep


def _setup_proc(cfg: TestbedConfig | None = None, core: bool = True) -> None:
    # One intra-op thread per process: a core and a hybrid process with two each would oversubscribe
    # the cores the bed runs on, and the slowdown would be the bed's, not the protocol's.
    torch.set_num_threads(1)
    if cfg is None:
        return
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    background = None
    if cfg.pin_cpus and len(cpus) > 1:
        # The core's training thread gets CPU 0 alone; its background threads and the hybrids share the
        # rest (a stand-in for the hybrids' own devices).
        os.sched_setaffinity(0, {cpus[0]} if core else set(cpus[1:]))
        background = set(cpus[1:])
    priority.configure(nice=cfg.background_nice, cpus=background)


# -- processes -------------------------------------------------------------------------------------
def _core_main(cfg: TestbedConfig, rank: int, host: str, port: int, outdir: str) -> None:
    _setup_proc(cfg, core=True)
    out: dict[str, Any] = {"params": {}, "step_s": {}, "cpu_s": {}, "metrics": [], "error": None}
    core = None
    try:
        store = connect(host, port, timeout_s=max(60.0, cfg.runtime.domain_timeout_s))  # a loaded machine may take seconds
        group = None
        if cfg.replica_size > 1:
            dist.init_process_group("gloo", store=dist.PrefixStore("core/", store), rank=rank,
                                    world_size=cfg.replica_size, timeout=datetime.timedelta(seconds=60))
            group = dist.distributed_c10d._get_default_group()
        rep = build_replica(cfg, CORE, rank, group)
        kv = KV(store, cfg.runtime.namespace)
        core = ElasticCore(store, cfg.runtime, rank, cfg.replica_size, group, os.path.join(outdir, "snapshots"),
                           rep.state, hybrids=[(h, cfg.replica_size) for h in cfg.hybrids],
                           initially_training=cfg.static, corrupt_snapshots=cfg.corrupt)
        if core.is_leader:
            # The bed measures joins from a ready pool: every hybrid rank is up (beating) before step 0.
            for rid in cfg.hybrids:
                for k in range(cfg.replica_size):
                    kv.wait(f"hb/{rid}/{k}", 120.0)
        first_real: dict[str, int] = {}
        done_at: int | None = None
        step = cfg.start_step
        out["params"][step] = rep.flat_params()
        while step < cfg.max_steps:
            if core.is_leader:
                cont = _leader_schedule(cfg, core, step, first_real)
                if cont and cfg.join_at and done_at is None and _resolved(cfg, core, step, first_real):
                    done_at = step
                if done_at is not None and step >= done_at + cfg.tail_steps:
                    cont = False
                kv.set(f"tb/continue/{step}", cont)
            else:
                cont = kv.wait(f"tb/continue/{step}", 300.0)
            if not cont:
                break
            t0, c0 = time.perf_counter(), time.thread_time()
            core.begin_step(step)  # before forward, as the AReaL hook does: the plan is known early
            weight = rep.compute_gradients(step)
            if cfg.step_sleep_s:
                time.sleep(cfg.step_sleep_s)
            m = core.reduce_gradients(step, rep.grad_tensors(), weight)
            rep.apply_update()
            out["step_s"][step] = time.perf_counter() - t0
            out["cpu_s"][step] = time.thread_time() - c0  # the training thread's own CPU time
            step += 1
            out["params"][step] = rep.flat_params()
            if core.is_leader:
                m = {"step": step - 1, "loss": rep.last_loss, **m,
                     "members": list(core.members)}
                out["metrics"].append(m)
            if cfg.save_state_at is not None and step == cfg.save_state_at:
                torch.save(rep.state(), os.path.join(outdir, f"state_v{step}_p{rank}.pt"))
        out["final_step"] = step
        out["process_cpu_s"] = time.process_time()  # all threads: training + background
        out["train_cpu_s"] = time.thread_time()
        if core.is_leader:
            out["first_real"] = first_real
            out["events"] = core.events
            out["pool"] = {rid: {"state": h.state.value, "gen": h.generation, "alive": h.alive,
                                 "history": h.history} for rid, h in core.pool.hybrid.items()}
            out["snapshot_versions"] = core.snapshots.versions(0)
    except Exception:  # noqa: BLE001 - reported to the parent through the result file
        out["error"] = traceback.format_exc()
    finally:
        if core is not None:
            core.shutdown()
        torch.save(out, os.path.join(outdir, f"core{rank}.pt"))
        _exit_now()


def _leader_schedule(cfg: TestbedConfig, core: ElasticCore, step: int, first_real: dict[str, int]) -> bool:
    for rid, at in cfg.join_at.items():
        if at == step:
            core.request_join(rid)
    for ev in core.events:
        if ev["event"] == "first_real_gradient" and ev["rid"] not in first_real:
            first_real[ev["rid"]] = ev["step"]
    for rid, after in cfg.release_after.items():
        h = core.pool.hybrid[rid]
        if rid in first_real and step == first_real[rid] + after and h.state == ReplicaState.TRAINING:
            core.request_release(rid)
    return True


def _resolved(cfg: TestbedConfig, core: ElasticCore, step: int, first_real: dict[str, int]) -> bool:
    """Every scheduled join has finished (trained, or failed/rolled back) and every scheduled release too."""
    for rid, at in cfg.join_at.items():
        h = core.pool.hybrid[rid]
        if step <= at:
            return False
        if not h.alive or (h.state == ReplicaState.ROLLOUT and rid not in first_real and h.generation >= 2):
            continue
        if rid not in first_real:
            return False
        if rid in cfg.release_after and h.state != ReplicaState.ROLLOUT:
            return False
    return True


def _hybrid_main(cfg: TestbedConfig, rid: str, rank: int, host: str, port: int, outdir: str) -> None:
    _setup_proc(cfg, core=False)
    out: dict[str, Any] = {"error": None}
    try:
        store = connect(host, port, timeout_s=max(60.0, cfg.runtime.domain_timeout_s))  # a loaded machine may take seconds
        group = None
        if cfg.replica_size > 1:
            group = dist.ProcessGroupGloo(dist.PrefixStore(f"hybgrp/{rid}/", store), rank, cfg.replica_size,
                                          datetime.timedelta(seconds=60))
        rep = build_replica(cfg, rid, rank, group)
        rollout = QueueRollout(host, port, cfg.runtime.namespace, f"{rid}/{rank}") if cfg.rollout_requests else None
        start = (cfg.start_step, 1) if rid in cfg.static else None
        w = HybridWorker(host, port, cfg.runtime, rid, rank, os.path.join(outdir, "snapshots"), rep, rollout,
                         start_active=start, verbose=bool(os.environ.get("ELASTIC_VERBOSE")))
        res = w.run()
        out.update(res)
        out["final_params"] = rep.flat_params()
        out["served"] = rollout.served if rollout else 0
        out["process_cpu_s"] = time.process_time()
    except Exception:  # noqa: BLE001
        out["error"] = traceback.format_exc()
    torch.save(out, os.path.join(outdir, f"hyb_{rid}_{rank}.pt"))
    _exit_now()


def _exit_now() -> None:
    """End a bed process once its result is saved. A background thread may still sit in a collective
    with a peer that died (until domain_timeout_s); a normal interpreter exit could wait on it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# -- parent ----------------------------------------------------------------------------------------
def run(cfg: TestbedConfig, outdir: str | None = None) -> dict[str, Any]:
    """Run one configuration; returns {"core": [per rank], "hybrids": {rid: [per rank]}, "killed": ...}."""
    outdir = outdir or tempfile.mkdtemp(prefix="elastic_tb_")
    os.makedirs(outdir, exist_ok=True)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    kv = KV(store, cfg.runtime.namespace)
    if cfg.rollout_requests:
        push_requests(kv, list(range(cfg.rollout_requests)))
    # forkserver by default: forking the caller directly (fork) inherits whatever locks its other threads
    # (the store server, earlier tests' workers) hold at that moment, and a child rarely hung at start.
    start = start_method(os.environ.get("ELASTIC_TB_START", "forkserver"), cfg.runtime.backend)
    if start == "fork":
        # Building a replica the first time imports optimizer machinery (torch._dynamo, ~3 s of CPU):
        # do it once here so that every forked child inherits it instead of repeating it.
        build_replica(replace(cfg, init_state=None), CORE, 0, None).apply_update()
    ctx = mp.get_context(start)
    if start == "forkserver":
        # The server forks children from a single-threaded process (no lock held by another thread can
        # be inherited); it imports what a replica needs once, including the optimizer's lazy imports.
        ctx.set_forkserver_preload(["tests.rigs.elastic_bed", "tests.rigs._warm"])
    procs: dict[tuple[str, int], Any] = {}
    for r in range(cfg.replica_size):
        procs[(CORE, r)] = ctx.Process(target=_core_main, args=(cfg, r, "127.0.0.1", store.port, outdir))
        for rid in cfg.hybrids:
            procs[(rid, r)] = ctx.Process(target=_hybrid_main, args=(cfg, rid, r, "127.0.0.1", store.port, outdir))
    for p in procs.values():
        p.start()
    killed: dict[str, Any] | None = None
    deadline = time.monotonic() + cfg.timeout_s
    try:
        while any(p.is_alive() for (who, _), p in procs.items() if who == CORE):
            if time.monotonic() > deadline:
                raise TimeoutError(f"test bed run did not finish within {cfg.timeout_s}s; "
                                   f"{_diagnose(outdir, procs)}")
            if cfg.kill and killed is None:
                killed = _maybe_kill(cfg, kv, procs)
            if killed is not None and "resume_after_s" in cfg.kill and not killed.get("resumed") \
                    and time.time() - killed["t"] >= float(cfg.kill["resume_after_s"]):
                _signal(procs, killed["rid"], signal.SIGCONT)
                killed["resumed"] = True
            time.sleep(0.005 if cfg.kill else 0.05)  # fast only when it must catch a state to kill in
        kv.set("shutdown", 1)
        for (who, _r), p in procs.items():
            if killed is not None and who == killed["rid"] and not killed.get("resumed") and p.is_alive():
                p.kill()  # a stopped (hung) replica never exits by itself
            p.join(20)
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
                p.join(5)
    res: dict[str, Any] = {"core": [], "hybrids": {}, "killed": killed, "outdir": outdir}
    for r in range(cfg.replica_size):
        path = os.path.join(outdir, f"core{r}.pt")
        if not os.path.exists(path):
            raise RuntimeError(f"core rank {r} exited with code {procs[(CORE, r)].exitcode} and wrote no result")
        c = torch.load(path, weights_only=False)
        if c["error"]:
            raise RuntimeError(f"core rank {r} failed:\n{c['error']}")
        res["core"].append(c)
        for rid in cfg.hybrids:
            path = os.path.join(outdir, f"hyb_{rid}_{r}.pt")
            res["hybrids"].setdefault(rid, []).append(
                torch.load(path, weights_only=False) if os.path.exists(path) else None)
    if cfg.rollout_requests:
        res["rollout_done"] = {i: kv.get(f"rollout/done/{i}") for i in range(cfg.rollout_requests)}
        res["rollout_done_n"] = {i: int(kv.get(f"rollout/done_n/{i}", 0)) for i in range(cfg.rollout_requests)}
        cur, tot = int(kv.get("rollout/cursor", 0)), int(kv.get("rollout/total", 0))
        res["rollout_queued"] = [int(kv.get(f"rollout/ticket/{i}")) for i in range(cur, tot)]
    return res


def start_method(requested: str, backend: str = "gloo") -> str:
    """How to start bed processes. fork only for a CPU bed from a process that has not initialised
    CUDA: a forked child cannot use (or re-create) a CUDA context its parent created. Otherwise a fork
    server: a fresh interpreter with no CUDA context to inherit, whose preload (a CPU replica's step,
    see cpu_optim.py) does not initialise CUDA either, so its children can."""
    if requested == "fork" and (backend == "nccl" or torch.cuda.is_initialized()):
        return "forkserver"
    return requested


def _diagnose(outdir: str, procs: dict[tuple[str, int], Any]) -> str:
    """Who is still running, and the errors of those that finished (for a run that timed out)."""
    parts = [f"{who}/{r}: {'alive' if p.is_alive() else f'exit {p.exitcode}'}" for (who, r), p in procs.items()]
    for name in sorted(os.listdir(outdir)):
        if name.endswith(".pt") and (name.startswith("core") or name.startswith("hyb_")):
            try:
                err = torch.load(os.path.join(outdir, name), weights_only=False).get("error")
            except Exception as e:  # noqa: BLE001 - a half-written result
                err = f"unreadable: {e}"
            if err:
                parts.append(f"{name}: {str(err)[-600:]}")
    return "; ".join(parts)


def _maybe_kill(cfg: TestbedConfig, kv: KV, procs: dict[tuple[str, int], Any]) -> dict[str, Any] | None:
    assert cfg.kill is not None
    step = kv.get("cur_step")
    if step is None:
        return None
    plan = kv.get(f"plan/{step}")
    if not plan or plan.get("pool", {}).get(cfg.kill["rid"]) != cfg.kill["state"]:
        return None
    _signal(procs, cfg.kill["rid"], getattr(signal, cfg.kill.get("signal", "SIGKILL")))
    return {"rid": cfg.kill["rid"], "state": cfg.kill["state"], "step": step, "t": time.time()}


def _signal(procs: dict[tuple[str, int], Any], rid: str, sig: int) -> None:
    for (who, _r), p in procs.items():
        if who == rid and p.is_alive():
            os.kill(p.pid, sig)


def reference_runtime(rt: RuntimeConfig) -> RuntimeConfig:
    """The runtime of a reference run: nothing is injected into it, so no member may ever be declared
    dead there. Timeouts no loaded machine reaches (a live process descheduled for 2 s would otherwise
    be dropped by the fault handling, and the reference would silently become another run)."""
    return replace(rt, heartbeat_timeout_s=max(rt.heartbeat_timeout_s, 30.0),
                   domain_timeout_s=max(rt.domain_timeout_s, 60.0))


def equivalence_references(base: TestbedConfig, a: int, n: int, outdir: str, rid: str = "h0",
                           until: int | None = None, inject: dict[str, Any] | None = None
                           ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The two reference runs a join is compared with (core rank 0 results), for the tests and the bench.

    ref_a: the core alone for n steps, its state saved at version a (the joined run must equal it up to
    its activation step a). ref_b: from ref_a's state at a, `rid` a static member from the start, up to
    `until` (default n). Raises if ref_b ever trained without `rid`: such a run is no reference.
    `inject`: fault injection into ref_b (TestbedConfig.kill), for the test that the references hold."""
    ref_base = replace(base, runtime=reference_runtime(base.runtime), join_at={}, release_after={}, kill=None)
    ref_a = run(replace(ref_base, max_steps=n, hybrids=(), save_state_at=a), os.path.join(outdir, "ref_a"))["core"][0]
    ref_b = run(replace(ref_base, max_steps=until if until is not None else n, hybrids=(rid,), start_step=a,
                        static=(rid,), init_state=os.path.join(outdir, "ref_a", f"state_v{a}_p{{rank}}.pt"),
                        kill=inject), os.path.join(outdir, "ref_b"))["core"][0]
    lost = [m["step"] for m in ref_b["metrics"] if rid not in m["members"]]
    if lost:
        why = [e for e in ref_b["events"] if e["rid"] == rid and e["event"] in ("failed", "rolled_back")]
        raise RuntimeError(f"reference run trained without {rid} from step {lost[0]} ({why}): not a reference")
    return ref_a, ref_b


def with_runtime(cfg: TestbedConfig, **kw: Any) -> TestbedConfig:
    return replace(cfg, runtime=replace(cfg.runtime, **kw))
