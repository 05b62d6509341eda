"""A hybrid replica's rollout server in a live run: the registration channel.

Channel (keys in the elastic pool's store, next to the protocol keys of elastic_runtime/core.py):

    serve/<rid>               hybrid -> trainer  {"seq", "addr", "up": true|false, "size", "max_running"}
    serve_ack/<rid>/<seq>     trainer -> hybrid  seen: "pending" (up) or "removed" (down: no longer routed)
    serve_ack/<rid>/<seq>/active  trainer -> hybrid  the server took the latest weights and is routable

Up (the hybrid entered rollout, `modeswitch.HttpRollout.start`): its server runs on its own weights; the
trainer's `ServeRegistry` attaches it to the rollout fleet (`ServerFleet.attach_hybrid`, the one owner of
membership), which adds the address to the AReaL engine's `addresses` right before the next weight update
(so that update reaches it), and to the request router once that update has landed: the router never
sends it a request on weights older than the trainer's current version.
Down (the hybrid joins training, `HttpRollout.drain`): the registry detaches it (`ServerFleet.detach_hybrid`:
out of the router, no new request, and out of the engine's `addresses`, no further updates or pauses), then
acks; only then
does the hybrid abort its in-flight requests, which return to AReaL's client with their tokens so far
and are re-sent to another server (`RequestRouter.watch` treats a removed server as down). None lost.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Callable
from typing import Any

from areal_libra.elastic_runtime.kv import KV, connect
from areal_libra.server.inprocess import InProcessServer

log = logging.getLogger(__name__)


# ------------------------------------------------------------------ hybrid side
def serve_channel(kv: KV, rid: str, size: int, max_running: int, ack_timeout_s: float = 30.0
                  ) -> tuple[Callable[[str], None], Callable[[str], None]]:
    """(register, unregister) for `modeswitch.HttpRollout` on hybrid `rid`, over the pool's store."""
    current: dict[str, int] = {}

    def _addr(url: str) -> str:
        return url.removeprefix("http://").removeprefix("https://")

    def register(url: str) -> None:
        seq = kv.add(f"serve_seq/{rid}", 1)
        current["seq"] = seq
        kv.set(f"serve/{rid}", {"seq": seq, "addr": _addr(url), "up": True, "size": size,
                                "max_running": max_running})

    def unregister(url: str) -> None:
        seq = kv.add(f"serve_seq/{rid}", 1)
        kv.set(f"serve/{rid}", {"seq": seq, "addr": _addr(url), "up": False})
        try:
            # Until the trainer stopped routing here, an abort would only be re-sent to this server.
            kv.wait(f"serve_ack/{rid}/{seq}", ack_timeout_s, poll_s=min(2.0, ack_timeout_s))
        except TimeoutError:
            log.warning("%s: trainer did not ack the removal of %s in %.0fs; draining anyway", rid, url,
                        ack_timeout_s)

    return register, unregister


def inprocess_launch(engine: Any, root: str, threads: int, max_running: int, seed: int = 0,
                     pacing: Any = None) -> Callable[[Any], tuple[str, Callable[[], None]]]:
    """`launch(replica)` for HttpRollout: save the hybrid engine's current weights (HF format) and serve them
    with an embedded server inside this process (no second interpreter to start on a small machine).
    `pacing`: the server's Pacing (an emulated cluster paces it like its others: rollout.emulation.ServerPacing)."""
    count = [0]

    def launch(replica: Any) -> tuple[str, Callable[[], None]]:
        from areal.api.io_struct import SaveLoadMeta


        count[0] += 1
        path = os.path.join(root, f"weights{count[0]}")
        engine.save(SaveLoadMeta(path=path, weight_format="hf", with_optim=False, tokenizer=engine.tokenizer))
        srv = InProcessServer(path, pacing, max_running_requests=max_running, threads=threads, seed=seed)

        def stop() -> None:
            srv.close()
            shutil.rmtree(path, ignore_errors=True)

        return f"http://{srv.addr}", stop

    return launch


# ------------------------------------------------------------------ trainer side
class ServeRegistry:
    """Follows the hybrids' registration channel and asks the rollout fleet (rollout/fleet.py, the one owner
    of the engine's addresses, the router's layout and the weight-update hook) to attach and detach their
    servers: attached, a server is reached by the next weight update and routed once it landed; detached, it
    is neither routed nor updated. The registry keeps the per-hybrid view (pending, serving) and the acks."""

    def __init__(self, host: str, port: int, namespace: str, rids: list[str], fleet: Any,
                 group: str = "", poll_s: float = 0.1) -> None:
        self.kv = KV(connect(host, port), namespace)
        self.rids = list(rids)
        self.fleet, self.group = fleet, group
        self.poll_s = poll_s
        self._lock = threading.Lock()
        self.seen: dict[str, int] = {}
        self.pending: dict[str, tuple[str, int, dict[str, Any]]] = {}  # rid -> (addr, seq, info): not routed yet
        self.active: dict[str, tuple[str, dict[str, Any]]] = {}  # rid -> (addr, info): routable
        self.active_ever: set[str] = set()  # every address that was routable (metrics: requests routed there)
        self.registrations = 0
        self.removals = 0
        self.failed: list[str] = []
        self._acks: list[tuple[str, int, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elastic-serve", daemon=True)
        self._thread.start()

    def _ready(self, rid: str, seq: int, addr: str, ok: bool) -> None:
        """The fleet's word on an attached server (called as the weight update that reached it lands)."""
        with self._lock:
            if self.pending.get(rid, (None, None))[:2] != (addr, seq):
                return  # withdrawn meanwhile (the fleet has detached it)
            _, _, info = self.pending.pop(rid)
            if not ok:
                self.failed.append(addr)
                return
            self.active[rid] = (addr, info)
            self.active_ever.add(addr)
            self.registrations += 1
            self._acks.append((rid, seq, "active"))  # sent by the poll thread (one store client per thread)

    # -- the channel ----------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except Exception as e:  # noqa: BLE001 - the store went away at shutdown
                if not self._stop.is_set():
                    log.warning("elastic serve registry: %s", e)

    def poll(self) -> None:
        with self._lock:
            acks, self._acks = self._acks, []
        for rid, seq, what in acks:
            self.kv.set(f"serve_ack/{rid}/{seq}/{what}", 1)
        vals = self.kv.get_many([f"serve/{rid}" for rid in self.rids])
        for rid in self.rids:
            msg = vals.get(f"serve/{rid}")
            if msg is None or int(msg["seq"]) <= self.seen.get(rid, 0):
                continue
            self.seen[rid] = int(msg["seq"])
            if msg["up"]:
                addr, seq = msg["addr"], int(msg["seq"])
                with self._lock:
                    before = self.pending.get(rid, (None,))[0]
                    self.pending[rid] = (addr, seq, msg)
                if before is not None and before != addr:  # superseded before any update reached it
                    self.fleet.detach_hybrid(before)
                self.fleet.attach_hybrid(addr, self.group or None,
                                         lambda a, ok, rid=rid, seq=seq: self._ready(rid, seq, a, ok))
                self.kv.set(f"serve_ack/{rid}/{msg['seq']}", "pending")
            else:
                self._remove(rid, msg["addr"])
                self.kv.set(f"serve_ack/{rid}/{msg['seq']}", "removed")

    def _remove(self, rid: str, addr: str) -> None:
        with self._lock:
            if self.pending.get(rid, (None,))[0] == addr:
                del self.pending[rid]
            was_active = self.active.get(rid, (None,))[0] == addr
            if was_active:
                del self.active[rid]
        self.fleet.detach_hybrid(addr)  # outside our lock: the fleet takes its own
        if was_active:
            self.removals += 1

    def serving(self) -> dict[str, tuple[str, dict[str, Any]]]:
        with self._lock:
            return dict(self.active)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

