"""How rollout servers are started and stopped: one small protocol, so that the fleet (live reconfiguration,
revive) and the launcher's first launch never ask where or how a server runs.

    backend = LocalProcessBackend("embedded")   # or "sglang"
    [h] = backend.start("/ckpt/weight_update_v3", [ServerSpec(tp=2, group="long")], "logs",
                        devices=[("2", "3")], weight_version=3)
    h.addr                                      # host:port, as AReaL's clients expect it
    backend.stop(h)

A backend starts servers of TP ``spec.tp`` on the given devices serving the given weights (a model path or
a checkpoint), all at once, and returns once every one is healthy (ServerLaunchError otherwise, with none of
them left running). ``LocalProcessBackend`` is the launcher's subprocesses on this machine (rollout/launcher.py:
the embedded CPU server, or SGLang, as the launch starts them); ``SGLangBackend`` starts SGLang servers after
the launch (the fleet's), each with a seed, port range and dist-init address of its own. Other backends (an emulated host, a Ray actor, an SGLang command line on
another node) implement the same protocol and are handed to the fleet; the fleet is not edited for them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from areal_libra.rollout.launcher import (
    BACKENDS,
    ServerHandle,
    ServerSpec,
    _cuda_count,
    build_command,
    launch_servers,
    port_range,
    ports_in_range,
)
from areal_libra.rollout.placement import Placement, assign_gpus, visible_devices


class RunningServer(Protocol):
    """A started server, as a backend hands it back."""

    addr: str  # host:port
    spec: ServerSpec
    log_path: str
    gpu_ids: tuple[str, ...]  # its devices

    @property
    def pid(self) -> int | None: ...  # its process (servers.json, supervision), None where there is none here

    def alive(self) -> bool: ...


class ServerBackend(Protocol):
    """Starts and stops rollout servers (see the module doc)."""

    @property
    def name(self) -> str: ...  # how allocations are written: <name>:d1t1+d1t2

    @property
    def places_devices(self) -> bool: ...  # every server needs devices of its own (the fleet places them)

    def start(self, weights: str, specs: Sequence[ServerSpec], log_dir: str,
              devices: Sequence[tuple[str, ...]] | None = None, weight_version: int | None = None,
              timeout: float = 600.0) -> list[RunningServer]:
        """One server per spec on ``devices[i]`` (None: the backend's default) serving ``weights``, reporting
        ``weight_version`` where given; healthy when this returns."""
        ...

    def stop(self, server: RunningServer, timeout: float = 10.0) -> None: ...

    def adopt(self, addr: str, spec: ServerSpec, run_dir: str) -> RunningServer | None:
        """A handle on a server the launcher started (run_dir's records say how it runs), so the fleet stops
        and replaces it through this backend; None: the fleet keeps the launcher's pid for it."""
        ...


@dataclass(frozen=True)
class LocalProcessBackend:
    """Servers as subprocesses of this process, each in its own session (rollout/launcher.py)."""

    kind: str = "embedded"  # embedded | sglang
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if self.kind not in BACKENDS or self.kind == "auto":
            raise ValueError(f"server backend must be embedded or sglang, got {self.kind!r}")

    @classmethod
    def for_device(cls, device: str) -> LocalProcessBackend:
        """A run's servers by its libra.device: SGLang on cuda, else the embedded CPU server."""
        return cls("sglang" if device == "cuda" else "embedded")

    @property
    def name(self) -> str:
        return self.kind

    @property
    def places_devices(self) -> bool:
        return self.kind == "sglang"  # an embedded server runs on CPU: its devices are bookkeeping

    def start(self, weights: str, specs: Sequence[ServerSpec], log_dir: str,
              devices: Sequence[tuple[str, ...]] | None = None, weight_version: int | None = None,
              timeout: float = 600.0) -> list[ServerHandle]:
        if weight_version is not None and self.kind == "embedded":  # SGLang takes it from the weight update
            specs = [replace(s, extra_args=("--weight-version", str(weight_version), *s.extra_args)) for s in specs]
        placement = None if devices is None else Placement(trainer=(), servers=tuple(tuple(d) for d in devices))
        return launch_servers(weights, specs, log_dir, backend=self.kind, host=self.host, timeout=timeout,
                              placement=placement)

    def stop(self, server: ServerHandle, timeout: float = 10.0) -> None:
        server.terminate(timeout)

    def adopt(self, addr: str, spec: ServerSpec, run_dir: str) -> None:
        return None  # the launcher's subprocesses: the fleet stops them by the pid in servers.json


@dataclass
class SGLangBackend:
    """SGLang servers as subprocesses of this process, started after the launch (the fleet's new servers):
    each one AReaL's way (its sglang_server.py) with a seed, a port range and a dist-init address of its own.

    Server k of the run (k counts on from `first_index`, the servers the launch started: their seeds are
    `seed + 0 .. first_index - 1`) gets `--random-seed seed + k`. Its HTTP and dist-init ports come from the
    slice of AReaL's port range (launcher.port_range) that belongs to its first device on the node
    (`node_devices`, default the visible GPUs): servers alive together hold disjoint devices, so their
    slices are disjoint too, and the ports are checked free when taken (the launch's servers hold theirs)."""

    seed: int = 0
    first_index: int = 0
    host: str = "127.0.0.1"
    node_devices: tuple[str, ...] | None = None  # None: the visible GPUs (CUDA_VISIBLE_DEVICES or all)
    started: int = 0  # servers this backend has started
    areal_flags: tuple[str, ...] = ()  # the run's AReaL `sglang:` section (launcher.areal_sglang_flags)

    name = "sglang"
    places_devices = True

    def _devices(self) -> list[str]:
        if self.node_devices is not None:
            return list(self.node_devices)
        return visible_devices(os.environ, _cuda_count())

    def plan(self, specs: Sequence[ServerSpec], devices: Sequence[tuple[str, ...]] | None = None,
             ) -> tuple[list[ServerSpec], list[tuple[str, ...]], list[tuple[int, int]]]:
        """The next servers' specs (their seeds), devices and (HTTP, dist-init) ports; advances the count."""
        node = self._devices()
        if devices is None:
            devices = assign_gpus(node, 0, [s.tp for s in specs]).servers
        if len(devices) != len(specs):
            raise ValueError(f"{len(devices)} device sets for {len(specs)} servers")
        k0 = self.first_index + self.started
        out_specs = [replace(s, seed=self.seed + k0 + i, extra_args=(*self.areal_flags, *s.extra_args))
                     for i, s in enumerate(specs)]
        slots = max(len(node), 1)
        ports = []
        for i, devs in enumerate(devices):
            slot = node.index(devs[0]) if devs and devs[0] in node else (k0 + i) % slots
            http, dist = ports_in_range(2, *port_range(slot, slots), self.host)
            ports.append((http, dist))
        self.started += len(specs)
        return out_specs, [tuple(d) for d in devices], ports

    def commands(self, weights: str, specs: Sequence[ServerSpec],
                 devices: Sequence[tuple[str, ...]] | None = None) -> list[list[str]]:
        """The argv of the next servers, as start() would run them (for checks; advances the count)."""
        specs, _, ports = self.plan(specs, devices)
        return [build_command("sglang", weights, s, self.host, http, base_gpu_id=0, dist_init_port=dist)
                for s, (http, dist) in zip(specs, ports)]

    def start(self, weights: str, specs: Sequence[ServerSpec], log_dir: str,
              devices: Sequence[tuple[str, ...]] | None = None, weight_version: int | None = None,
              timeout: float = 600.0) -> list[ServerHandle]:
        # SGLang takes the weight version from the weight update, not from its command line.
        specs, devs, ports = self.plan(specs, devices)
        return launch_servers(weights, specs, log_dir, backend="sglang", host=self.host, timeout=timeout,
                              placement=Placement(trainer=(), servers=tuple(devs)), ports=ports)

    def stop(self, server: ServerHandle, timeout: float = 10.0) -> None:
        server.terminate(timeout)

    def adopt(self, addr: str, spec: ServerSpec, run_dir: str) -> None:
        return None  # the launcher's subprocesses: the fleet stops them by the pid in servers.json


def backend_for_device(device: str, seed: int = 0, first_index: int = 0,
                       areal_flags: Sequence[str] = ()) -> ServerBackend:
    """The backend of servers started after the launch: SGLang on cuda (seeds and ports of their own, after
    the launch's `first_index` servers), else the embedded CPU server."""
    if device == "cuda":
        return SGLangBackend(seed=seed, first_index=first_index, areal_flags=tuple(areal_flags))
    return LocalProcessBackend("embedded")
