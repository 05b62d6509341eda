"""Start, health-check and stop rollout servers as subprocesses.

On a machine with CUDA and the ``sglang`` package the servers are real SGLang
(``python -m sglang.launch_server``), one per ServerSpec, each on its own GPUs (its own
``CUDA_VISIBLE_DEVICES``, disjoint from the trainer's and the other servers': placement.py; the instance
mix may have different TP sizes); otherwise they are the project's embedded CPU server, which
speaks the same HTTP API. Every server logs to its own file; a server that dies or does not become healthy
in time fails the launch with its last log lines, and every server already started is stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from areal_libra.cmlfq import aging
from areal_libra.rollout.placement import Placement, PlacementError, assign_gpus, visible_devices
from areal_libra.utils import free_ports

BACKENDS = ("auto", "embedded", "sglang")


class ServerLaunchError(RuntimeError):
    """A server could not be started or did not become healthy."""


@dataclass(frozen=True)
class ServerSpec:
    """One rollout server instance: its tensor-parallel size, CPU threads (embedded), batch limit and the
    instance group it belongs to (e.g. a Libra bucket or a TP class)."""

    tp: int = 1
    threads: int | None = None  # embedded: compute threads; None = tp (a "TP t" CPU server runs t threads)
    max_running: int = 128
    group: str = "default"
    max_total_tokens: int | None = None
    seed: int = 0
    extra_args: tuple[str, ...] = ()
    # embedded: the module that starts the server (an emulated one: areal_libra.rollout.emulation, which
    # paces the embedded server it starts; it takes the --emulate-* flags among extra_args)
    entry: str = "areal_libra.server.embedded_server"

    @property
    def n_threads(self) -> int:
        return self.threads or self.tp


@dataclass
class ServerHandle:
    addr: str  # host:port, as AReaL's clients expect it
    proc: subprocess.Popen
    spec: ServerSpec
    log_path: str = ""
    backend: str = "embedded"
    gpu_ids: tuple[str, ...] = field(default_factory=tuple)  # its devices, as the launcher sees them

    @property
    def url(self) -> str:
        return f"http://{self.addr}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the server and its children at once (for fault-injection tests)."""
        _signal_group(self.proc, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)

    def terminate(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if still running after ``timeout`` seconds."""
        if self.proc.poll() is None:
            _signal_group(self.proc, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    # Servers run in their own session, so the group holds the server and only its children
    # (SGLang's scheduler and detokenizer processes).
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def resolve_backend(backend: str = "auto") -> str:
    """``auto`` → ``sglang`` when CUDA and the sglang package are present, else ``embedded``."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown server backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if backend != "auto":
        return backend
    if importlib.util.find_spec("sglang") is None:
        return "embedded"
    try:
        import torch

        return "sglang" if torch.cuda.is_available() else "embedded"
    except Exception:
        return "embedded"


def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no usable torch: no GPUs
        return 0


# AReaL 1.0.4's sglang_server.py: server i of n on a node takes its ports (HTTP and dist-init) from its own
# slice of [10000, 32767), so servers started together never race for the same port.
PORT_LO, PORT_SPAN = 10000, 22767


def port_range(index: int, n_servers: int) -> tuple[int, int]:
    """[lo, hi) of the ports server `index` of `n_servers` may take (AReaL's per-server slice)."""
    if not 0 <= index < n_servers:
        raise ValueError(f"server index {index} out of range for {n_servers} servers")
    width = PORT_SPAN // n_servers
    return PORT_LO + index * width, PORT_LO + (index + 1) * width


def ports_in_range(n: int, lo: int, hi: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports in [lo, hi) that were free a moment ago (held open together so they differ)."""
    import random
    import socket

    socks: list[socket.socket] = []
    try:
        for port in random.sample(range(lo, hi), min(hi - lo, 4096)):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            socks.append(s)
            if len(socks) == n:
                return [x.getsockname()[1] for x in socks]
        raise ServerLaunchError(f"no {n} free ports in [{lo}, {hi}) on {host}")
    finally:
        for x in socks:
            x.close()


def build_command(
    backend: str, model_path: str, spec: ServerSpec, host: str, port: int, base_gpu_id: int = 0,
    dist_init_port: int | None = None,
) -> list[str]:
    """The server's command line (written to SGLang 0.5's real CLI for the GPU path; every flag is parsed by
    sglang 0.5.10.post1's ServerArgs in tests/sglang). `dist_init_port`: SGLang's torch.distributed
    rendezvous (--dist-init-addr host:port), one per server as AReaL gives it; None: SGLang picks one."""
    if backend not in ("embedded", "sglang"):
        raise ValueError(f"backend must be embedded or sglang, got {backend!r}")
    module = spec.entry if backend == "embedded" else "sglang.launch_server"
    cmd = [sys.executable, "-m", module, "--model-path", model_path, "--host", host, "--port", str(port),
           "--tp-size", str(spec.tp), "--max-running-requests", str(spec.max_running)]
    if backend == "embedded":
        cmd += ["--threads", str(spec.n_threads), "--seed", str(spec.seed), "--parent-pid", str(os.getpid())]
    else:
        cmd += ["--base-gpu-id", str(base_gpu_id), "--random-seed", str(spec.seed), "--log-level", "warning"]
        if dist_init_port is not None:
            cmd += ["--dist-init-addr", f"{host}:{dist_init_port}"]
    if spec.max_total_tokens is not None:
        cmd += ["--max-total-tokens", str(spec.max_total_tokens)]
    return cmd + list(spec.extra_args)


# SGLang flags the launcher sets per server (build_command) and AReaL's `sglang:` section must not repeat.
_OWN_SGLANG_KEYS = frozenset({"model_path", "tokenizer_path", "tp_size", "base_gpu_id", "host", "port",
                              "dist_init_addr", "random_seed", "max_running_requests", "nnodes", "node_rank",
                              "log_level", "pp_size"})


def areal_sglang_flags(sglang_config: Any) -> tuple[str, ...]:
    """The SGLang flags AReaL 1.0.4's own launcher derives from a run's `sglang:` section (its
    SGLangConfig.build_args: memory fraction, context length, dtype, radix cache, chunked prefill, attention
    backend, metrics, ...), less the per-server ones build_command sets (model, TP, ports, seed, running
    requests). Bool flags AReaL leaves off are absent, as in AReaL's command line."""
    from areal.api.cli_args import SGLangConfig, get_py_cmd
    from omegaconf import OmegaConf

    if not isinstance(sglang_config, SGLangConfig):  # a DictConfig section: typed by AReaL's own dataclass
        sglang_config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(SGLangConfig), sglang_config))
    args = SGLangConfig.build_args(sglang_config, tp_size=1, base_gpu_id=0)
    return tuple(get_py_cmd("sglang", {k: v for k, v in args.items() if k not in _OWN_SGLANG_KEYS})[3:])


def libra_sglang_flags(sglang_config: Any, bound_lag: bool) -> tuple[str, ...]:
    """A Libra run's SGLang flags: AReaL's (areal_sglang_flags), then, with the bounded version lag
    (LibraConfig.bound_lag in libra mode), cmlfq.aging.SGLANG_FLAGS, which order each server's waiting queue
    by the request priority the router sets (the trajectory's start version, oldest first). They come last:
    their --schedule-policy fcfs overrides AReaL's default lpm (SGLang's priority scheduling takes fcfs or
    lof only)."""
    flags = areal_sglang_flags(sglang_config)
    return (*flags, *aging.SGLANG_FLAGS) if bound_lag else flags


def server_env_overlay(backend: str, spec: ServerSpec, base_env: dict[str, str] | None,
                       gpus: tuple[str, ...] = ()) -> dict[str, str]:
    """What the launcher sets in a server's environment on top of `base_env` (the launcher's own when None)."""
    base = os.environ if base_env is None else base_env
    env: dict[str, str] = {}
    if "TOKENIZERS_PARALLELISM" not in base:
        env["TOKENIZERS_PARALLELISM"] = "false"
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = Placement.visible(gpus)  # its own GPUs only (base GPU id 0)
    if backend == "embedded":
        # Keep BLAS/OpenMP pools to the server's share of the cores.
        for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[k] = str(spec.n_threads)
        # Idle OpenMP workers sleep instead of spinning: on a shared machine spinning workers of one
        # multi-threaded server starve everything else (measured 10x slower decode steps with 2 threads).
        for k, v in (("OMP_WAIT_POLICY", "PASSIVE"), ("TORCHDYNAMO_DISABLE", "1")):
            if k not in base:
                env[k] = v
    return env


def tail(path: str, n: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no log)"


def is_healthy(addr: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"http://{addr}/health", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _exit_code(h: Any) -> str:
    return f"with code {h.proc.poll()}"


def wait_healthy(servers: Sequence[Any], timeout: float, how: Callable[[Any], str] = _exit_code) -> None:
    """Block until every server (addr, spec, log_path, alive(): a ServerHandle or any backend's handle) answers
    /health 200; raise with the culprit's log tail otherwise. `how` words an exit ("with code 1")."""
    deadline = time.monotonic() + timeout
    pending = list(servers)
    while pending:
        for h in list(pending):
            if is_healthy(h.addr):
                pending.remove(h)
            elif not h.alive():
                raise ServerLaunchError(
                    f"server {h.addr} (group {h.spec.group}) exited {how(h)} during start-up; "
                    f"last lines of {h.log_path}:\n{tail(h.log_path)}"
                )
        if not pending:
            return
        if time.monotonic() > deadline:
            h = pending[0]
            raise ServerLaunchError(
                f"server {h.addr} (group {h.spec.group}) not healthy after {timeout:.0f}s; "
                f"last lines of {h.log_path}:\n{tail(h.log_path)}"
            )
        time.sleep(0.25)


@dataclass(frozen=True)
class ServerLaunch:
    """One server exactly as launch_servers starts it: its command line, what the launcher adds to its
    environment, its address, devices and log file (`python -m areal_libra.launch ... --dry-run` prints these)."""

    argv: list[str]
    env: dict[str, str]  # on top of the launcher's environment (server_env_overlay)
    addr: str
    gpus: tuple[str, ...]
    log_path: str
    spec: ServerSpec


def plan_servers(
    model_path: str,
    specs: Sequence[ServerSpec],
    log_dir: str,
    backend: str = "auto",
    host: str = "127.0.0.1",
    env: dict[str, str] | None = None,
    placement: Placement | None = None,
    ports: Sequence[tuple[int, int | None]] | None = None,
) -> list[ServerLaunch]:
    """The command lines, environments, ports and devices of one server per spec; starts nothing, writes
    nothing (ports were free a moment ago). Server i runs on `placement.servers[i]` (sglang's default: the
    visible GPUs from the first on, no trainer; PlacementError when they do not fit). `ports`: (HTTP port,
    dist-init port) per server, chosen by the caller (a backend that starts servers later,
    rollout/backend.SGLangBackend); None: chosen here."""
    backend = resolve_backend(backend)
    if not specs:
        return []
    gpus: list[tuple[str, ...]] = [()] * len(specs)
    if backend == "sglang" and placement is None:
        placement = assign_gpus(visible_devices(env if env is not None else os.environ, _cuda_count()), 0,
                                [s.tp for s in specs])
    if placement is not None:  # embedded servers run on CPU; their devices are bookkeeping (a device pool)
        if [len(g) for g in placement.servers] != [s.tp for s in specs]:
            raise ValueError(f"placement {placement.servers} does not match the servers' TP sizes")
        gpus = list(placement.servers)
    if ports is not None:
        if len(ports) != len(specs):
            raise ValueError(f"{len(ports)} port pairs for {len(specs)} servers")
        ports, dist_ports = [p[0] for p in ports], [p[1] for p in ports]
    elif backend == "sglang":  # AReaL's way: an HTTP and a dist-init port from each server's own range
        pairs = [ports_in_range(2, *port_range(i, len(specs)), host) for i in range(len(specs))]
        ports, dist_ports = [p[0] for p in pairs], [p[1] for p in pairs]
    else:
        ports, dist_ports = free_ports(len(specs), host), [None] * len(specs)
    return [ServerLaunch(argv=build_command(backend, model_path, spec, host, port, base_gpu_id=0,
                                            dist_init_port=dist_ports[i]),
                         env=server_env_overlay(backend, spec, env, gpus[i]), addr=f"{host}:{port}", gpus=gpus[i],
                         log_path=os.path.join(log_dir, f"server{i}_{spec.group}_{port}.log"), spec=spec)
            for i, (spec, port) in enumerate(zip(specs, ports))]


def launch_servers(
    model_path: str,
    specs: Sequence[ServerSpec],
    log_dir: str,
    backend: str = "auto",
    host: str = "127.0.0.1",
    timeout: float = 600.0,
    env: dict[str, str] | None = None,
    placement: Placement | None = None,
    ports: Sequence[tuple[int, int | None]] | None = None,
) -> list[ServerHandle]:
    """Start one server per spec as plan_servers describes them (all at once), wait until all are healthy,
    return their handles. On any failure every server started here is stopped before ServerLaunchError is
    raised."""
    backend = resolve_backend(backend)
    launches = plan_servers(model_path, specs, log_dir, backend, host, env, placement, ports)
    if not launches:
        return []
    os.makedirs(log_dir, exist_ok=True)
    base = dict(os.environ if env is None else env)
    handles: list[ServerHandle] = []
    try:
        for sl in launches:
            with open(sl.log_path, "ab") as log:
                log.write(f"$ {' '.join(sl.argv)}\n".encode())
                log.flush()
                proc = subprocess.Popen(
                    sl.argv,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env={**base, **sl.env},
                    start_new_session=True,
                )
            handles.append(ServerHandle(sl.addr, proc, sl.spec, sl.log_path, backend, sl.gpus))
        wait_healthy(handles, timeout)
    except BaseException:
        shutdown(handles)
        raise
    return handles


def shutdown(handles: Sequence[ServerHandle], timeout: float = 10.0) -> None:
    """Stop every server: SIGTERM to all, wait up to ``timeout`` in total, then SIGKILL what is left."""
    for h in handles:
        if h.alive():
            _signal_group(h.proc, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for h in handles:
        try:
            h.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            h.kill()
        # Children of a server that exited on its own may still hold the group.
        _signal_group(h.proc, signal.SIGKILL)


def server_infos(handles: Sequence[ServerHandle]) -> list:
    """AReaL ``LocalInfServerInfo`` records for already-running servers: pass them as
    ``RolloutController.initialize(role, server_infos=...)`` so AReaL connects instead of launching SGLang.
    (``process`` is left None: these servers belong to the launcher, which stops them.)"""
    from areal.api import LocalInfServerInfo

    out = []
    for h in handles:
        host, port = h.addr.rsplit(":", 1)
        out.append(LocalInfServerInfo(host=host, port=int(port), process=None))
    return out


@contextlib.contextmanager
def servers(model_path: str, specs: Sequence[ServerSpec], log_dir: str, **kwargs) -> Iterator[list[ServerHandle]]:
    """``with servers(...) as handles:`` — launch, yield, always shut down."""
    handles = launch_servers(model_path, specs, log_dir, **kwargs)
    try:
        yield handles
    finally:
        shutdown(handles)


def main(argv: list[str] | None = None) -> int:
    class _Parser(argparse.ArgumentParser):
        def error(self, message: str) -> None:
            sys.stderr.write(f"launcher: error: {message}\n")
            raise SystemExit(2)

    p = _Parser(prog="python -m areal_libra.rollout.launcher", description="Start rollout servers until Ctrl-C.")
    p.add_argument("--model-path", required=True)
    p.add_argument("--tp", type=int, nargs="+", default=[1], help="one TP size per server")
    p.add_argument("--threads", type=int, default=None, help="compute threads per server (default: its TP)")
    p.add_argument("--max-running", type=int, default=128)
    p.add_argument("--log-dir", default="server_logs")
    p.add_argument("--backend", default="auto", choices=BACKENDS)
    p.add_argument("--timeout", type=float, default=600.0)
    a = p.parse_args(argv)
    if not os.path.isfile(os.path.join(a.model_path, "config.json")):
        p.error(f"--model-path {a.model_path!r} is not a Hugging Face model directory (no config.json)")
    if any(t < 1 for t in a.tp) or (a.threads is not None and a.threads < 1) or a.max_running < 1:
        p.error("--tp, --threads and --max-running must be >= 1")
    specs = [ServerSpec(tp=t, threads=a.threads, max_running=a.max_running, group=f"tp{t}") for t in a.tp]
    try:
        handles = launch_servers(a.model_path, specs, a.log_dir, backend=a.backend, timeout=a.timeout)
    except ServerLaunchError as e:
        sys.stderr.write(f"launcher: error: {e}\n")
        return 1
    except PlacementError as e:
        sys.stderr.write(f"launcher: error: {e}\n")
        return 2
    print(",".join(h.addr for h in handles), flush=True)
    try:
        while all(h.alive() for h in handles):
            time.sleep(1)
        sys.stderr.write("launcher: error: a server exited; stopping the others\n")
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        shutdown(handles)


if __name__ == "__main__":
    sys.exit(main())
