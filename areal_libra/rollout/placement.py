"""Which GPUs the trainer and each rollout server get on one node: disjoint, trainer first.

The devices are the node's visible ones (``CUDA_VISIBLE_DEVICES`` of the launcher if set, else
0..count-1). The trainer takes the first ``trainer_gpus``; then each server, in launch order, takes
the next ``tp`` devices. Every process is started with ``CUDA_VISIBLE_DEVICES`` set to its own devices
only (as AReaL's local launcher does), so a server's ``--base-gpu-id`` is 0 and the trainer's
``LOCAL_RANK=0`` is its own first device: no two processes can land on the same GPU.

Servers the trainer starts later (a reconfiguration, a replacement for a dead one: fleet.py) take devices
from the rollout pool (every visible device but the trainer's, passed to the trainer in
``AREAL_LIBRA_ROLLOUT_DEVICES``) that no live server holds. When they do not fit beside every live server
(a full node), ``servers_to_retire`` names the leaving servers to stop first (break-before-make).
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

ROLLOUT_DEVICES_ENV = "AREAL_LIBRA_ROLLOUT_DEVICES"


class PlacementError(ValueError):
    """The allocation does not fit the node's GPUs (one-line message)."""


@dataclass(frozen=True)
class Placement:
    trainer: tuple[str, ...]  # device ids, as the launcher sees them
    servers: tuple[tuple[str, ...], ...]  # per server, in launch order
    pool: tuple[str, ...] = ()  # every device but the trainer's: what rollout servers may ever use

    @staticmethod
    def visible(devices: Sequence[str]) -> str:
        """The CUDA_VISIBLE_DEVICES value of a process owning `devices`."""
        return ",".join(devices)


def visible_devices(env: Mapping[str, str], count: int) -> list[str]:
    """The node's devices as the launcher sees them: its CUDA_VISIBLE_DEVICES, else 0..count-1."""
    vis = env.get("CUDA_VISIBLE_DEVICES")
    if vis is not None and vis.strip():
        return [d.strip() for d in vis.split(",") if d.strip()]
    return [str(i) for i in range(count)]


def assign_gpus(devices: Sequence[str], trainer_gpus: int, server_tps: Sequence[int]) -> Placement:
    """Trainer devices first, then each server's `tp` devices in order; PlacementError if it does not fit."""
    if trainer_gpus < 0 or any(tp < 1 for tp in server_tps):
        raise PlacementError(f"bad allocation: trainer {trainer_gpus} GPUs, server TP sizes {list(server_tps)}")
    if len(set(devices)) != len(devices):
        raise PlacementError(f"device list {list(devices)} names a device twice")
    need = trainer_gpus + sum(server_tps)
    if need > len(devices):
        servers = "+".join(str(t) for t in server_tps) or "0"
        raise PlacementError(
            f"the allocation needs {need} GPUs (trainer {trainer_gpus} + servers {servers}) but "
            f"{len(devices)} are visible ({','.join(devices) or 'none'}); use fewer or smaller rollout servers")
    trainer = tuple(devices[:trainer_gpus])
    out, at = [], trainer_gpus
    for tp in server_tps:
        out.append(tuple(devices[at:at + tp]))
        at += tp
    return Placement(trainer, tuple(out), tuple(devices[trainer_gpus:]))


def place_new_servers(pool: Sequence[str], held: Collection[str], server_tps: Sequence[int]) -> Placement:
    """Devices for servers started while others serve: the next free ones of the rollout ``pool`` (``held``:
    the devices of live servers); PlacementError if they do not fit. Never a device outside the pool."""
    if not pool:
        raise PlacementError(f"no rollout device pool ({ROLLOUT_DEVICES_ENV} unset): a new server could land on "
                             "the trainer's GPU")
    free = [d for d in pool if d not in held]
    try:
        got = assign_gpus(free, 0, server_tps)
    except PlacementError:
        raise PlacementError(
            f"the new servers need {sum(server_tps)} GPUs (TP {'+'.join(map(str, server_tps))}) but {len(free)} of "
            f"the {len(pool)} rollout devices are free ({','.join(free) or 'none'}); the rest serve the current "
            "layout") from None
    return Placement((), got.servers, tuple(pool))


def servers_to_retire(pool: Sequence[str], held: Mapping[str, Sequence[str]], leaving: Sequence[str],
                      server_tps: Sequence[int]) -> list[str]:
    """Which leaving servers must stop before servers of `server_tps` can start (break-before-make).

    ``held``: each live server's devices, by address; ``leaving``: the addresses the new layout drops.
    Empty when the new servers fit beside every live server. Otherwise the leaving servers that free the
    fewest devices (then the fewest servers, then the earliest in ``leaving``), so that as much of the old
    layout as possible serves while the new servers start. PlacementError when they would not fit even
    with every leaving server stopped."""
    need = sum(server_tps)
    pool_set = set(pool)
    busy = {d for devs in held.values() for d in devs}
    free = len([d for d in pool if d not in busy])
    if need <= free:
        return []
    own = {a: len([d for d in held.get(a, ()) if d in pool_set]) for a in leaving}
    best: tuple[int, int, tuple[str, ...]] | None = None  # (devices freed, servers, which)
    for k in range(1, len(leaving) + 1):
        for combo in itertools.combinations(leaving, k):
            freed = sum(own[a] for a in combo)
            if free + freed >= need and (best is None or (freed, k) < best[:2]):
                best = (freed, k, combo)
    if best is None:
        raise PlacementError(
            f"the new servers need {need} GPUs (TP {'+'.join(map(str, server_tps))}) but only "
            f"{free + sum(own.values())} of the {len(pool)} rollout devices would be free with every leaving "
            "server stopped; the servers the new layout keeps hold the rest")
    return list(best[2])
