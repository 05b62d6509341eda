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
the embedded CPU server, or SGLang). Other backends (an emulated host, a Ray actor, an SGLang command line on
another node) implement the same protocol and are handed to the fleet; the fleet is not edited for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from areal_libra.rollout.launcher import BACKENDS, ServerHandle, ServerSpec, launch_servers
from areal_libra.rollout.placement import Placement


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
