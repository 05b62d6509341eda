"""An emulated host: one process serving many emulated rollout servers, each its own SGLang-API endpoint on
its own port, that run no model. Their time is the emulated hardware's.

    python -m areal_libra.rollout.emulated_host --model qwen3-14b --gpu h200 --time-scale 0.5 --port 0 \
        [--address-file F] [--parent-pid P]

Each emulated server drives the simulator's own server model (areal_libra.sim.server.RolloutServer:
continuous batching at decode-iteration granularity, KV capacity, admission, preemption, prefill of only
the new tokens while a context stays cached, per-server speed noise) in real time: a chunk of decode
iterations that the model says ends at emulated time t ends at real time t0 + time_scale * t. Emulation is
the hardware, so reading the simulator's truth here is allowed (the planner, cost model and controller must
not). A request carries its emulated sizes: ``sampling_params.max_new_tokens`` is the number of tokens the
turn generates (counted, not computed) and the request id ``<uuid>~<trajectory>~<context tokens>~<last>``
(``emulated_rid``) names the trajectory (its KV stays cached between turns on this server), the emulated
context before the turn and whether a tool call follows. A response holds a few real token ids
(``REAL_TOKENS``) and reports the emulated count in ``meta_info.completion_tokens``.

A request aborted before it finished (``/abort_request``, ``/pause_generation`` in abort mode, as AReaL's
weight update does) answers with no tokens; the host remembers how many emulated tokens it had generated, so
when AReaL's client sends it again (to this or another server of the host) only the rest is generated,
after its whole context is prefilled again (a migration or a flushed cache, as in the simulator).
``/update_weights_from_disk`` loads nothing: it takes the truth's weight-sync time and flushes the KV cache.

Control API (the EmulatedHostBackend's): ``POST /servers`` {"specs": [{tp, max_running, group, seed}],
"weight_version"} starts servers and returns their addresses; ``POST /stop`` {"addr"}; ``GET /servers``;
``GET /pacing``: the host's pacing fidelity, ``pacing_error`` = the sum of overruns (how late a paced chunk
or weight sync completed) over the sum of their targets; and its servers' busy accelerator-seconds
(``busy_gpu_s``, the simulator's server busy time x TP), ``serving_gpus`` and its clock ``now_s``, from which
the trainer measures the rollout busy share of each step (live.live_cluster.LiveControl).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import sys
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from areal_libra.rollout.emulation import EmulationError, _check_scale, emulated_truth
from areal_libra.rollout.launcher import ServerLaunchError, ServerSpec
from areal_libra.sim.hardware import HardwareTruth
from areal_libra.sim.server import RolloutServer, SimRequest
from areal_libra.trace import Segment
from areal_libra.utils import atomic_write_text, pid_alive

REAL_TOKENS = 2  # real token ids a response carries; the rest of the turn's tokens are counted
TOKEN_ID = 11  # the id they carry (inside any tokenizer's vocabulary)
RID_SEP = "~"
_VERSIONED_PATH = re.compile(r"weight_update_v(\d+)/?$")


def emulated_rid(uid: str, trajectory: str, context_tokens: int, last: bool) -> str:
    """The request id that carries a turn's emulated sizes to an emulated server."""
    return RID_SEP.join((uid, trajectory.replace(RID_SEP, "-"), str(int(context_tokens)), "1" if last else "0"))


def parse_rid(rid: str, n_input: int) -> tuple[str, int, bool]:
    """(trajectory, emulated context tokens, last turn) of a request id; a plain id is a one-turn request
    whose context is its real input."""
    parts = rid.split(RID_SEP)
    if len(parts) == 4 and parts[2].isdigit():
        return parts[1], int(parts[2]), parts[3] == "1"
    return rid, n_input, True


class _Turn:
    """The one segment a request generates (SimRequest reads traj.segments[seg].gen_tokens)."""

    __slots__ = ("segments", "prompt_tokens")

    def __init__(self, gen: int, ctx: int = 0) -> None:
        self.segments = (Segment(max(1, gen), None),)
        self.prompt_tokens = ctx


@dataclass
class _Pending:
    rid: str
    gen: int
    fut: asyncio.Future
    t0: float
    last: bool
    traj: str
    ctx: int


@dataclass
class PacingStats:
    """Paced chunks (decode iterations with their admission prefill) and weight syncs: targets and overruns,
    in real seconds."""

    chunks: int = 0
    target_s: float = 0.0
    overrun_s: float = 0.0
    late_chunks: int = 0
    syncs: int = 0

    def add(self, target: float, overrun: float) -> None:
        self.chunks += 1
        self.target_s += max(0.0, target)
        if overrun > 0:
            self.overrun_s += overrun
            self.late_chunks += 1

    @property
    def error(self) -> float:
        return self.overrun_s / self.target_s if self.target_s > 0 else 0.0


class EmulatedServer:
    """One emulated SGLang server (see the module doc) on the host's event loop."""

    def __init__(self, host: EmulatedHost, sid: int, tp: int, max_running: int, group: str, seed: int,
                 weight_version: str) -> None:
        self.host, self.sid, self.tp, self.group = host, sid, tp, group
        self.max_running = max_running
        self.sim = RolloutServer(sid, tp, 0, host.truth, random.Random(seed), max_running=max_running)
        self.weight_version = weight_version
        self.paused = False
        self._resume = asyncio.Event()
        self._resume.set()
        self.pending: dict[SimRequest, _Pending] = {}
        self.by_rid: dict[str, SimRequest] = {}
        self.parked: dict[str, SimRequest] = {}  # trajectory -> its request, KV cached between turns
        self._timer: asyncio.TimerHandle | None = None
        self._kick_soon = False
        self._chunk_began = 0.0
        self.stats = PacingStats()
        self.generated = 0
        self.requests = 0
        self.runner: web.AppRunner | None = None
        self.addr = ""
        self.stopped = False

    # --------------------------------------------------------------- the batch, in emulated time
    def _kick(self) -> None:
        if not self._kick_soon:
            self._kick_soon = True
            asyncio.get_running_loop().call_soon(self._step)

    def _step(self) -> None:
        self._kick_soon = False
        if self.stopped:
            return
        now = self.host.now()
        self._settle(now)
        if self.sim.chunk is None and not self.paused:
            self._start(now)

    def _settle(self, now: float) -> None:
        """End the running chunk at `now`: whole if its time is up (late by now - t_end), else at the next
        iteration boundary (an arrival joins the batch there)."""
        ch = self.sim.chunk
        if ch is None:
            return
        s = self.host.time_scale
        if now >= ch[7]:
            t_end = ch[7]
            done = self.sim.finish_chunk()
            self.stats.add((t_end - self._chunk_began) * s, (now - t_end) * s)
        else:
            done = self.sim.interrupt(now)
            self.stats.add((self.sim.clock - self._chunk_began) * s, 0.0)
        self._finish(done)

    def _start(self, now: float) -> None:
        r = self.sim.start_chunk(now)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if r is None:
            return
        t_end, epoch = r
        self._chunk_began = now
        self._timer = asyncio.get_running_loop().call_at(self.host.real(t_end), self._chunk_end, epoch)

    def _chunk_end(self, epoch: int) -> None:
        self._timer = None
        if self.stopped or self.sim.epoch != epoch or self.sim.chunk is None:
            return
        now = self.host.now()
        t_end = self.sim.chunk[7]
        self._settle(max(now, t_end))  # a timer is never early by design; float noise aside
        if not self.paused:
            # The next chunk begins where the truth says this one ended, not when this process woke up: a late
            # wake-up delays the responses (counted as an overrun) but does not slow the server down.
            self._start(t_end)

    def _finish(self, done: list[SimRequest]) -> None:
        for req in done:
            p = self.pending.pop(req, None)
            if p is None:
                continue
            self.by_rid.pop(p.rid, None)
            self.generated += p.gen
            if not p.last:
                self.sim.park(req, p.ctx + p.gen)
                self.parked[p.traj] = req
            self._respond(p, p.gen, "stop")

    def _respond(self, p: _Pending, gen_done: int, kind: str, message: str = "") -> None:
        if p.fut.done():
            return
        n_real = min(REAL_TOKENS, gen_done) if kind != "abort" else 0
        ids = [TOKEN_ID] * n_real
        reason: dict[str, Any] = {"type": kind}
        if kind == "stop":
            reason["matched"] = None
        if message:
            reason["message"] = message
        meta = {
            "id": p.rid, "finish_reason": reason, "prompt_tokens": p.ctx, "completion_tokens": gen_done,
            "cached_tokens": 0, "weight_version": self.weight_version,
            "e2e_latency": time.perf_counter() - p.t0,
            "output_token_logprobs": [[-0.5, t, None] for t in ids],
        }
        p.fut.set_result({"text": "", "output_ids": ids, "meta_info": meta})

    def abort(self, rids: list[str] | None, message: str) -> int:
        """Abort these requests (None: every one); remember what each had generated."""
        self._settle(self.host.now())
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        targets = list(self.pending) if rids is None else [self.by_rid[r] for r in rids if r in self.by_rid]
        sim = self.sim
        for req in targets:
            p = self.pending.pop(req)
            self.by_rid.pop(p.rid, None)
            if req in sim.active:
                base = sim.active.pop(req)
                sim.sum_base -= base
                req.heap_seq = -1
                done = base + sim.it - p.ctx
            else:
                sim.queue = type(sim.queue)(x for x in sim.queue if x[0] is not req)
                done = req.done_tokens
            self.host.progress[p.rid] = max(0, min(p.gen - 1, done))
            self._respond(p, 0, "abort", message)
        if not self.paused:
            self._kick()
        return len(targets)

    # --------------------------------------------------------------- HTTP
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        r = app.router
        r.add_post("/generate", self.generate)
        for path in ("/health", "/health_generate"):
            r.add_get(path, self.health)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        r.add_get("/get_weight_version", self.get_weight_version)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        for path in ("/release_memory_occupation", "/resume_memory_occupation"):
            r.add_post(path, self.ok)
        return app

    async def generate(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            ids = body["input_ids"]
            sp = body.get("sampling_params") or {}
            gen = int(sp.get("max_new_tokens", 128))
            rid = str(body.get("rid") or f"r{time.time_ns()}")
            prio = None if body.get("priority") is None else int(body["priority"])
            if not isinstance(ids, list) or not ids or gen < 0:
                raise ValueError("input_ids must be a non-empty list and max_new_tokens >= 0")
        except (ValueError, KeyError, TypeError) as e:
            return web.json_response({"error": {"message": f"emulated server: bad request: {e}"}}, status=400)
        await self._resume.wait()
        traj, ctx, last = parse_rid(rid, len(ids))
        loop = asyncio.get_running_loop()
        p = _Pending(rid, max(1, gen), loop.create_future(), time.perf_counter(), last, traj, ctx)
        if gen == 0:
            self._respond(p, 0, "length")
            return web.json_response(p.fut.result())
        sim = self.sim
        req = self.parked.pop(traj, None)
        if req is None or req in self.pending:
            req = SimRequest(_Turn(p.gen, ctx), None, 0, self.host.now())
        done = self.host.progress.pop(rid, 0)
        req.traj, req.seg, req.done_tokens, req.ctx = _Turn(p.gen), 0, done, ctx
        if prio is not None:  # Libra's bounded lag: the oldest start version first, as its simulator (RunConfig.edf)
            req.start_version, sim.edf = prio, True
        cached = sim.idle_cache.get(req) if done == 0 else None
        if cached is not None and cached <= ctx:
            prior, new = cached, ctx - cached
        else:
            sim.drop_cache(req)
            prior, new = 0, ctx + done
        self.requests += 1
        self.pending[req] = p
        self.by_rid[rid] = req
        sim.enqueue(req, prior, new)
        self._kick()
        return web.json_response(await p.fut)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.stopped else 200)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.host.model, "tokenizer_path": self.host.model,
                                  "is_generation": True, "weight_version": self.weight_version})

    def info(self) -> dict[str, Any]:
        sim = self.sim
        st = self.stats
        return {
            "addr": self.addr, "group": self.group, "tp_size": self.tp, "backend": "emulated",
            "max_running_requests": self.max_running, "num_running_requests": sim.batch,
            "num_waiting_requests": len(sim.queue), "num_used_tokens": sim.kv(),
            "max_total_num_tokens": sim.capacity, "weight_version": self.weight_version, "paused": self.paused,
            "engine_stats": {"requests": self.requests, "generated_tokens": self.generated,
                             "paced_chunks": st.chunks, "pace_target_seconds": st.target_s,
                             "pace_overrun_seconds": st.overrun_s, "late_chunks": st.late_chunks,
                             "preemptions": sim.preemptions, "busy_emulated_s": sim.busy_s},
            "emulation": {"model": self.host.model, "gpu": self.host.gpu, "tp": self.tp,
                          "time_scale": self.host.time_scale, "pacing_error": st.error},
        }

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response(self.info())

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.weight_version})

    async def flush_cache(self, request: web.Request) -> web.Response:
        self.sim.idle_cache.clear()
        self.sim.idle_tokens = 0
        self.parked.clear()
        return web.Response(text="Cache flushed.\n")

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await _body(request)
        self.paused = True
        self._resume.clear()
        if (body.get("mode") or "abort") == "abort":
            self.abort(None, "Abort by pause_generation")
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self.paused = False
        self._resume.set()
        self._kick()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _body(request)
        if body.get("abort_all"):
            self.abort(None, "Aborted by abort_request")
        elif body.get("rid"):
            self.abort([str(body["rid"])], "Aborted by abort_request")
        return web.Response(status=200)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        """Loads nothing: the weight sync takes the truth's time (paced), the KV cache is flushed."""
        body = await _body(request)
        path = str(body.get("model_path") or "")
        version = body.get("weight_version")
        if version is None:
            m = _VERSIONED_PATH.search(path)
            version = m.group(1) if m else None
        target = self.host.time_scale * self.host.truth.weight_sync_s(max(1, len(self.host.servers)))
        t0 = time.perf_counter()
        await asyncio.sleep(target)
        self.stats.syncs += 1
        self.stats.add(target, time.perf_counter() - t0 - target)
        if version is not None:
            self.weight_version = str(version)
        await self.flush_cache(request)
        return web.json_response({"success": True, "message": "Succeeded to update model weights.",
                                  "num_paused_requests": 0})

    async def ok(self, request: web.Request) -> web.Response:
        return web.json_response({"success": True, "message": "No-op on an emulated server."})


async def _body(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


class EmulatedHost:
    """The emulated servers of one process and its control API (module doc)."""

    def __init__(self, truth: HardwareTruth, model: str, gpu: str, time_scale: float, host: str = "127.0.0.1"):
        self.truth, self.model, self.gpu = truth, model, gpu
        self.time_scale = float(time_scale)
        self.host = host
        self.servers: dict[str, EmulatedServer] = {}
        self.progress: dict[str, int] = {}  # rid -> emulated tokens generated before an abort
        self._sid = 0
        self._retired = PacingStats()  # the stopped servers' pacing
        self._retired_busy = 0.0  # the stopped servers' busy accelerator-seconds (emulated)
        self._t0 = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None

    # emulated time (seconds since the host started) <-> the loop's clock
    def now(self) -> float:
        return (self._loop.time() - self._t0) / self.time_scale

    def real(self, t: float) -> float:
        return self._t0 + t * self.time_scale

    async def start_server(self, tp: int, max_running: int, group: str, seed: int, weight_version: str) -> str:
        if tp < 1 or tp > self.truth.gpu.gpus_per_node or self.truth.kv_capacity_tokens(tp) <= 0:
            raise ValueError(f"TP{tp} cannot serve {self.model} on {self.gpu}")
        self._sid += 1
        s = EmulatedServer(self, self._sid, tp, max_running, group, seed, weight_version)
        runner = web.AppRunner(s.app(), access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, self.host, 0, backlog=1024)
        await site.start()
        port = runner.addresses[0][1]
        s.runner, s.addr = runner, f"{self.host}:{port}"
        self.servers[s.addr] = s
        return s.addr

    async def stop_server(self, addr: str) -> bool:
        s = self.servers.pop(addr, None)
        if s is None:
            return False
        s.abort(None, "Server stopped")
        s.stopped = True
        if s.runner is not None:
            await s.runner.cleanup()
        return True

    def pacing(self) -> dict[str, Any]:
        st = [s.stats for s in self.servers.values()] + [self._retired]
        now = self.now() if self._loop is not None else 0.0
        target = sum(x.target_s for x in st)
        over = sum(x.overrun_s for x in st)
        return {"pacing_error": over / target if target > 0 else 0.0, "target_s": target, "overrun_s": over,
                "chunks": sum(x.chunks for x in st), "late_chunks": sum(x.late_chunks for x in st),
                "servers": len(self.servers), "time_scale": self.time_scale,
                "generated_tokens": sum(s.generated for s in self.servers.values()),
                # the rollout side's measured use (elastic.measure.rollout_busy_share): busy accelerator-seconds
                # of every server so far (the running chunks' part before now included: a reading at a step's
                # end must not wait for them to finish), the accelerators serving now and the host's clock, in
                # real seconds
                "busy_gpu_s": self.time_scale * (self._retired_busy + sum(s.sim.busy_at(now) * s.tp
                                                                           for s in self.servers.values())),
                "serving_gpus": sum(s.tp for s in self.servers.values()),
                "now_s": now * self.time_scale}

    # --------------------------------------------------------------- control API
    def control_app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/servers", self._c_start)
        app.router.add_post("/stop", self._c_stop)
        app.router.add_get("/servers", self._c_list)
        app.router.add_get("/pacing", self._c_pacing)
        app.router.add_get("/health", lambda r: self._ok())
        return app

    async def _ok(self) -> web.Response:
        return web.Response(status=200)

    async def _c_start(self, request: web.Request) -> web.Response:
        body = await _body(request)
        wv = str(body.get("weight_version", "default"))
        addrs = []
        try:
            for spec in body.get("specs") or []:
                addrs.append(await self.start_server(int(spec.get("tp", 1)), int(spec.get("max_running", 256)),
                                                     str(spec.get("group", "default")), int(spec.get("seed", 0)),
                                                     wv))
        except (ValueError, TypeError, OSError) as e:
            for a in addrs:
                await self.stop_server(a)
            return web.json_response({"error": str(e)}, status=400)
        return web.json_response({"servers": addrs})

    async def _c_stop(self, request: web.Request) -> web.Response:
        addr = str((await _body(request)).get("addr", ""))
        s = self.servers.get(addr)
        if s is not None:
            self._retired.chunks += s.stats.chunks
            self._retired.target_s += s.stats.target_s
            self._retired.overrun_s += s.stats.overrun_s
            self._retired.late_chunks += s.stats.late_chunks
            self._retired_busy += s.sim.busy_at(self.now()) * s.tp  # the running chunk served until now
        return web.json_response({"stopped": await self.stop_server(addr)})

    async def _c_list(self, request: web.Request) -> web.Response:
        return web.json_response({"servers": [s.info() for s in self.servers.values()]})

    async def _c_pacing(self, request: web.Request) -> web.Response:
        return web.json_response(self.pacing())

    async def serve(self, port: int, address_file: str | None, parent_pid: int | None) -> None:
        self._loop = asyncio.get_running_loop()
        self._t0 = self._loop.time()
        runner = web.AppRunner(self.control_app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, port)
        await site.start()
        addr = f"{self.host}:{runner.addresses[0][1]}"
        if address_file:
            atomic_write_text(address_file, json.dumps({"addr": addr, "pid": os.getpid()}) + "\n")
        print(f"emulated host serving on {addr}", flush=True)
        profile_to = os.environ.get(PROFILE_ENV)  # where the host's time goes (a diagnostic): cProfile stats
        prof = None
        if profile_to:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        try:
            tick = 0
            while parent_pid is None or pid_alive(parent_pid):
                await asyncio.sleep(1.0)
                tick += 1
                if prof is not None and tick % 20 == 0:  # the host may be SIGKILLed: dump as it goes
                    prof.dump_stats(profile_to)
        finally:
            if prof is not None:
                prof.disable()
                prof.dump_stats(profile_to)
            for a in list(self.servers):
                await self.stop_server(a)
            await runner.cleanup()


PROFILE_ENV = "AREAL_LIBRA_PROFILE_HOST"  # a path: the host process writes its cProfile stats there
HOST_FILE = "emulated_host.json"  # in the run directory: the host's control address and pid


def _call(addr: str, path: str, body: dict | None = None, timeout: float = 30.0) -> dict:
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{addr}{path}", data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"{}")


@dataclass
class EmulatedServerHandle:
    """A server of the emulated host (the RunningServer protocol); its process is the host's."""

    addr: str
    spec: Any
    host_pid: int | None
    log_path: str = ""
    gpu_ids: tuple[str, ...] = ()
    proc: Any = None  # the host's Popen where this process started it (the launcher's shutdown stops it)
    stopped: bool = False  # stopped through the backend

    @property
    def pid(self) -> int | None:
        return self.host_pid

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()

    def alive(self) -> bool:
        if self.stopped:
            return False
        if self.proc is not None:  # the launcher's view (polled often): the host process
            return self.proc.poll() is None
        try:
            import urllib.request

            with urllib.request.urlopen(f"http://{self.addr}/health", timeout=5.0) as r:
                return r.status == 200
        except OSError:
            return False


@dataclass
class EmulatedHostBackend:
    """The ServerBackend of an emulated host: servers start and stop inside the host process (one more
    backend behind the fleet; rollout/backend.py)."""

    control: str  # host:port of the host's control API
    host_pid: int | None = None
    log_path: str = ""
    proc: Any = None  # the host's Popen where this process started it
    # Leaving servers' requests move at once with their tokens so far (the host keeps their progress), as the
    # simulator's retired servers' do, instead of holding the step while long emulated turns finish.
    drain_timeout_s: float = 0.0

    @property
    def name(self) -> str:
        return "embedded"  # allocations read embedded:d..t..; the servers report backend "emulated"

    @property
    def places_devices(self) -> bool:
        return False

    def start(self, weights: str, specs: Any, log_dir: str, devices: Any = None, weight_version: int | None = None,
              timeout: float = 600.0) -> list[EmulatedServerHandle]:

        body = {"specs": [{"tp": s.tp, "max_running": s.max_running, "group": s.group, "seed": s.seed}
                          for s in specs],
                "weight_version": "default" if weight_version is None else str(weight_version)}
        try:
            addrs = _call(self.control, "/servers", body, timeout)["servers"]
        except (OSError, ValueError, KeyError) as e:
            raise ServerLaunchError(f"emulated host {self.control}: cannot start servers: {e}") from None
        return [EmulatedServerHandle(a, s, self.host_pid, self.log_path, proc=self.proc) for a, s in zip(addrs, specs)]

    def stop(self, server: Any, timeout: float = 10.0) -> None:
        if isinstance(server, EmulatedServerHandle):
            server.stopped = True
        try:
            _call(self.control, "/stop", {"addr": server.addr}, timeout)
        except (OSError, ValueError):
            pass  # the host is gone: so is the server

    def adopt(self, addr: str, spec: ServerSpec, run_dir: str) -> EmulatedServerHandle:
        """A handle on a server of this host that another process started (the launcher's first servers):
        it stops through the host, never by pid (the pid is the host's)."""
        return EmulatedServerHandle(addr, spec, self.host_pid, self.log_path)

    def pacing(self, timeout: float = 10.0) -> dict[str, Any]:
        """The host's pacing fidelity (GET /pacing)."""
        return _call(self.control, "/pacing", None, timeout)

    @classmethod
    def from_run_dir(cls, run_dir: Any) -> EmulatedHostBackend | None:
        """The backend of the host a launch started (HOST_FILE in the run directory), None without one."""
        from pathlib import Path

        try:
            rec = json.loads((Path(run_dir) / HOST_FILE).read_text())
            return cls(str(rec["addr"]), rec.get("pid"), str(rec.get("log", "")))
        except (OSError, ValueError, KeyError, TypeError):
            return None


def launch_host(model: str, gpu: str, time_scale: float, run_dir: Any, timeout: float = 60.0,
                parent_pid: int | None = None) -> tuple[EmulatedHostBackend, Any]:
    """Start the emulated host process (its own session; it exits with `parent_pid`, default this process)
    and wait for its control address. Returns (the backend, the Popen)."""
    import subprocess
    from pathlib import Path


    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    addr_file = run_dir / (HOST_FILE + ".tmp")
    addr_file.unlink(missing_ok=True)
    log_path = run_dir / "emulated_host.log"
    log = open(log_path, "w")  # noqa: SIM115 - the child holds it
    proc = subprocess.Popen(
        [sys.executable, "-m", "areal_libra.rollout.emulated_host", "--model", model, "--gpu", gpu,
         "--time-scale", repr(float(time_scale)), "--address-file", str(addr_file),
         "--parent-pid", str(parent_pid or os.getpid())],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    deadline = time.monotonic() + timeout
    while not addr_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            tail = log_path.read_text()[-400:] if log_path.exists() else ""
            raise ServerLaunchError(f"emulated host did not start: {tail.strip().splitlines()[-1:] or 'timeout'}")
        time.sleep(0.1)
    rec = json.loads(addr_file.read_text())
    rec["log"] = str(log_path)
    atomic_write_text(run_dir / HOST_FILE, json.dumps(rec) + "\n")
    addr_file.unlink(missing_ok=True)
    return EmulatedHostBackend(rec["addr"], proc.pid, str(log_path), proc), proc


def main(argv: list[str] | None = None) -> int:

    ap = argparse.ArgumentParser(prog="python -m areal_libra.rollout.emulated_host", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--gpu", required=True)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--address-file", default=None)
    ap.add_argument("--parent-pid", type=int, default=None)
    args = ap.parse_args(argv)
    try:
        truth = emulated_truth(args.model, args.gpu)
        scale = _check_scale(args.time_scale)
    except EmulationError as e:
        print(f"emulated_host: error: {e}", file=sys.stderr)
        return 2
    if not math.isfinite(scale):
        return 2
    host = EmulatedHost(truth, args.model, args.gpu, scale, args.host)
    try:
        asyncio.run(host.serve(args.port, args.address_file, args.parent_pid))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
