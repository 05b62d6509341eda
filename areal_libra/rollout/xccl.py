"""The xccl (NCCL on GPU, gloo on CPU) weight-update group over a changing server set, on trainer rank 0.

AReaL forms the group once (FSDPEngine/MegatronEngine.connect_engine): the trainer is rank 0, server i's TP
ranks follow from the server sizes (patch 11: `WeightUpdateMeta.gen_server_sizes`, offset 1 + the sizes of
the servers before it), and every later weight update broadcasts over it. When the fleet changes the server
set, the group must be formed again over the new set, in the engine's address order:

    group = WeightGroup(trainer.actor, trainer.rollout, trainer.weight_update_meta)
    group.recreate(["h:1", "h:2"], [1, 2])   # one TP1 and one TP2 server: ranks 1 and 2-3, world 4

`recreate` gives the new group a fresh name (``update_weight_group_r<n>``), has every server join it
(/init_weights_update_group with the payloads of AReaL's own request builder, patch 11's offsets) while rank 0
joins here, and only then switches the train engine to it and destroys the old one (here and, best effort,
on the servers that held it: /destroy_weights_update_group). A failure - the first server that refuses, or
the rendezvous timing out - leaves the old group in place (WeightGroupError, one line). (An SGLang server
that had joined the failed rendezvous is busy until its own timeout; the old group is still its.)
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import itertools
import json
import logging
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from areal_libra.rollout.groups import xccl_rank_offsets
from areal_libra.utils import first_line, free_port

log = logging.getLogger(__name__)

GROUP_PREFIX = "update_weight_group"  # AReaL's name for the first group
# Group names are never reused in a process (torch refuses a name a live group holds, e.g. one whose
# formation failed on the other side and is still waiting).
_GENERATIONS = itertools.count(1)


class WeightGroupError(RuntimeError):
    """The group could not be formed over the new server set; the old one is still in place."""


class WeightGroup:
    """Re-forms the weight-update group of `train_engine` (AReaL's engine on rank 0: the attributes
    weight_update_group(s), weight_update_group_names, weight_update_master_addr/port) over a server set,
    through `rollout` (AReaL's RemoteInfEngine or the engine wrapping it) with `meta` (the trainer's xccl
    WeightUpdateMeta: its gen_server_sizes follows the new set)."""

    def __init__(self, train_engine: Any, rollout: Any, meta: Any, timeout_s: float = 120.0,
                 master_address: str | None = None) -> None:
        if getattr(meta, "type", None) != "xccl":
            raise ValueError(f"a weight-update group needs an xccl WeightUpdateMeta, got {getattr(meta, 'type', None)!r}")
        alloc = getattr(meta, "gen_allocation", None)
        if alloc is not None and alloc.parallel.pp_size > 1:
            # AReaL forms one group per inference PP stage there; re-forming those is not done here.
            raise ValueError("re-forming the xccl weight-update group needs inference PP 1 "
                             f"(the rollout allocation has PP {alloc.parallel.pp_size})")
        self.engine = train_engine
        self.inner = getattr(rollout, "_engine", rollout)
        self.meta = meta
        self.timeout_s = timeout_s
        self.master_address = master_address
        self.generation = 0
        self.members: tuple[tuple[str, int], ...] | None = None  # (addr, size) in rank order; None: AReaL's

    def payloads(self, addrs: Sequence[str], sizes: Sequence[int]) -> list[dict]:
        """What each server is sent (AReaL's SGLang request builder with patch 11's sizes)."""
        meta = self._meta(sizes, "127.0.0.1", 0, f"{GROUP_PREFIX}_r<n>")
        backend = self.inner.backend
        return [backend.build_init_weights_group_request(a, i, meta).payload for i, a in enumerate(addrs)]

    def _meta(self, sizes: Sequence[int], addr: str, port: int, name: str) -> Any:
        meta = copy.copy(self.meta)
        meta.gen_server_sizes = [int(s) for s in sizes]
        meta.nccl_master_address, meta.nccl_master_port, meta.nccl_group_name = addr, port, name
        return meta

    def recreate(self, addrs: Sequence[str], sizes: Sequence[int]) -> None:
        """Form the group over `addrs` (TP sizes `sizes`, rank order) and switch the train engine to it."""
        import torch.distributed as dist
        from areal.engine.core.distributed import init_custom_process_group
        from areal.infra.platforms import current_platform
        from areal.utils.network import gethostip

        addrs, sizes = list(addrs), [int(s) for s in sizes]
        if len(addrs) != len(sizes) or not addrs:
            raise WeightGroupError(f"weight-update group: {len(addrs)} servers but {len(sizes)} sizes")
        _, world = xccl_rank_offsets(sizes)
        name = f"{GROUP_PREFIX}_r{next(_GENERATIONS)}"
        host = self.master_address or gethostip()
        meta = self._meta(sizes, host, free_port(host), name)
        old_pg = getattr(self.engine, "weight_update_group", None)
        old_names = list(getattr(self.engine, "weight_update_group_names", None)
                         or [getattr(self.engine, "weight_update_group_name", GROUP_PREFIX)])
        old_members = self.members
        saved = list(self.inner.addresses)
        # Rank 0 joins in a thread of its own while the servers do (each request blocks until the whole group
        # has met); the rendezvous gives up after timeout_s when a server never comes.
        joined: list = []

        def join() -> None:
            try:
                joined.append(init_custom_process_group(
                    backend=current_platform.communication_backend, world_size=world, rank=0,
                    init_method=f"tcp://{host}:{meta.nccl_master_port}", group_name=name,
                    timeout=datetime.timedelta(seconds=self.timeout_s)))
            except Exception as e:  # noqa: BLE001 - handed to the waiting thread
                joined.append(e)

        t = threading.Thread(target=join, name="xccl-group-join", daemon=True)
        try:
            t.start()
            self._init_on_servers(addrs, meta, joined)
            t.join(timeout=self.timeout_s + 10)
            if not joined or isinstance(joined[0], BaseException):
                raise WeightGroupError(first_line(joined[0]) if joined else "rank 0 did not join in time")
            pg = joined[0]
        except Exception as e:  # noqa: BLE001 - any failure: one line, the old group stays
            raise WeightGroupError(f"the weight-update group over {', '.join(addrs)} could not be formed: "
                                   f"{first_line(e)}") from e
        self.generation += 1
        self.inner.addresses = addrs  # the updates go to the members, in rank order
        eng = self.engine
        eng.weight_update_group = pg
        eng.weight_update_groups = [pg]
        eng.weight_update_group_names = [name]  # FSDPEngine's
        if hasattr(eng, "weight_update_group_name"):  # MegatronEngine's (PP 1: its rank 0 broadcasts)
            eng.weight_update_group_name = name
        eng.weight_update_master_addr, eng.weight_update_master_port = host, meta.nccl_master_port
        self.meta.gen_server_sizes = list(sizes)  # the trainer's meta follows the servers
        self.members = tuple(zip(addrs, sizes))
        if old_pg is not None:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(old_pg)
        # The servers of the old group that are still here drop it (frees their communicator); best effort:
        # a server that does not answer is on its way out.
        old_addrs = [a for a, _ in old_members] if old_members is not None else saved
        for a in old_addrs:
            for old in old_names:
                with contextlib.suppress(urllib.error.URLError, OSError, ValueError):
                    _post(a, "/destroy_weights_update_group", {"group_name": old}, timeout=10)
        log.info("xccl: weight-update group %s over %s (sizes %s, world %d)", name, addrs, sizes, world)


    def _init_on_servers(self, addrs: list[str], meta: Any, joined: list) -> None:
        """Every server joins (AReaL's request builder: patch 11's offsets by position). The first refusal
        fails the formation at once - the others would only wait for the rendezvous to time out (AReaL's own
        init_weights_update_group gathers them all first)."""
        backend = self.inner.backend
        reqs = [backend.build_init_weights_group_request(a, i, meta) for i, a in enumerate(addrs)]
        results: queue.Queue[tuple[str, str | None]] = queue.Queue()

        def call(addr: str, req: Any) -> None:
            try:
                r = _post(addr, req.endpoint, req.payload, timeout=self.timeout_s)
                results.put((addr, None if r.get("success", True) else str(r.get("message"))))
            except urllib.error.HTTPError as e:
                try:
                    msg = str(json.loads(e.read() or b"{}").get("message") or e)
                except ValueError:
                    msg = str(e)
                results.put((addr, msg))
            except Exception as e:  # noqa: BLE001 - reported as this server's answer
                results.put((addr, first_line(e)))

        for a, req in zip(addrs, reqs):
            threading.Thread(target=call, args=(a, req), name="xccl-group-init", daemon=True).start()
        deadline = time.monotonic() + self.timeout_s + 10
        for _ in addrs:
            while True:
                if joined and isinstance(joined[0], BaseException):  # rank 0 failed: nobody can finish
                    raise WeightGroupError(f"rank 0: {first_line(joined[0])}")
                try:
                    addr, err = results.get(timeout=0.5)
                    break
                except queue.Empty:
                    if time.monotonic() > deadline:
                        raise WeightGroupError("a server did not answer /init_weights_update_group in time") from None
            if err is not None:
                raise WeightGroupError(f"server {addr}: {err}")


def _post(addr: str, path: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(f"http://{addr}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"{}")
