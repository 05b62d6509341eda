"""Embedded CPU inference server speaking SGLang's native HTTP API.

    python -m areal_libra.server.embedded_server --model-path DIR --host 127.0.0.1 --port N \
        [--tp-size T] [--max-running-requests B] [--threads K] [--max-total-tokens M] [--seed S] \
        [--prefix-cache-tokens P]

SGLang cannot run on a CPU-only machine, so on CPU the project serves rollouts with this server instead:
the same endpoints, bodies and response shapes (as SGLang 0.5's own HTTP server), so AReaL's own
SGLang client talks to it unchanged. Generation is done by batching.BatchEngine (continuous batching
with a KV cache) on a Hugging Face causal LM. A CPU server runs the model unsharded; ``--tp-size T`` gives
it T intra-op compute threads (``--threads`` overrides), so a "TP 2" server can use two cores where a TP 1
server uses one (docs/dispatch.md has the measured ratio). A server may be given a ``Pacing``: every decode
iteration and prefill then takes the wall time it names (an emulated accelerator: started as
``python -m areal_libra.rollout.emulation --emulate-model M --emulate-gpu G <server flags>``, which builds the
pacing from the simulator's hardware truth and calls ``run`` here), while the tiny model computes the tokens.
The server itself knows nothing of emulation: it is a leaf of the package.

Semantics worth knowing (matching SGLang 0.5):
- ``output_ids`` and ``meta_info.output_token_logprobs`` hold every generated token, including a matched
  stop token and the tokens that spell a matched stop string; ``text`` leaves the stop token out and is
  cut before the stop string (``no_stop_trim`` keeps it). Stop strings are matched in the decoded tail
  of the output only.
- Logprobs are log_softmax(logits / temperature) of the sampled token (greedy: temperature 1), after
  frequency/presence penalties, before top-k/top-p.
- Sampling is seeded per request (``sampling_params.sampling_seed``, else server seed + arrival index)
  with a counter-based generator, so a request's sample does not depend on its batch mates.
- Aborted requests (pause mode abort, /abort_request, client disconnect) return finish reason abort with
  the tokens so far; a request aborted before its prefill says "Abort before prefill", which AReaL's
  client reads as "no tokens". While paused, new requests wait for /continue_generation.
- ``cached_tokens`` counts prompt tokens whose keys/values were reused: an identical prompt in the same
  admission wave, or a previous turn of the conversation held in the prefix cache.
- Not supported (400 with a message): images, LoRA, streaming, n > 1, grammars, min_p, repetition
  penalty, NCCL weight updates (/init_weights_update_group, /update_weights_from_distributed).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

from areal_libra.server import memory_debug
from areal_libra.server.protocol import RequestError, finish_text, names, parse_generate, short
from areal_libra.utils import pid_alive

if TYPE_CHECKING:  # batching imports torch, which the CLI's argument checks do without
    from areal_libra.server.batching import Pacer

_VERSIONED_PATH = re.compile(r"^weight_update_v(\d+)$")

logger = logging.getLogger("areal_libra.embedded_server")

SERVER_VERSION = "areal_libra-embedded-1 (SGLang 0.5 native API)"
FLUSH_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


@dataclass
class ServerArgs:
    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    tp_size: int = 1
    max_running_requests: int = 128
    threads: int = 1
    max_total_tokens: int = 262144
    prefix_cache_tokens: int = 32768
    seed: int = 0
    default_max_new_tokens: int = 128
    weight_version: str = "default"
    parent_pid: int | None = None  # exit when this process is gone (set by the launcher)


class Pacing(Protocol):
    """What paces a server to an accelerator it does not have (areal_libra.rollout.emulation builds one and
    hands it to ``EmbeddedServer``/``run``); injected so that the server imports nothing above server/."""

    def pacer(self, weight_version: Callable[[], str]) -> Pacer:
        """The engine's pacer; ``weight_version`` reads the weights the server serves now."""
        ...

    def describe(self) -> dict[str, Any]:
        """What is emulated, for /get_server_info."""
        ...


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


async def _json_body(request: web.Request, allow_empty: bool = True) -> dict[str, Any]:
    raw = await request.read()
    if not raw.strip():
        if allow_empty:
            return {}
        raise RequestError("request body must be a JSON object")
    try:
        body = json.loads(raw)
    except RecursionError:
        raise RequestError("request body is not valid JSON: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, and UnicodeDecodeError for bytes that are no UTF-8/16/32
        raise RequestError(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    return body


def _check_fields(body: dict[str, Any], allowed: set[str], endpoint: str) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise RequestError(f"Unknown field(s) in {endpoint} request: {names(unknown)}")


def _opt_bool(body: dict[str, Any], key: str) -> bool:
    v = body.get(key)
    if v is not None and not isinstance(v, bool):
        raise RequestError(f"{key} must be a boolean, got {short(v)}")
    return bool(v)


def load_model(path: str) -> tuple[Any, Any]:
    """Load a Hugging Face causal LM and its tokenizer on CPU in float32."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model path {path!r} is not a Hugging Face model directory (no config.json)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def _shape_signature(model: Any) -> tuple[Any, ...]:
    c = model.config
    return (
        c.model_type,
        int(model.get_output_embeddings().weight.shape[0]),
        c.hidden_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        getattr(c, "num_key_value_heads", None),
    )


class EmbeddedServer:
    """HTTP front end: validates requests, hands them to the engine thread, shapes the responses."""

    def __init__(self, args: ServerArgs, model: Any, tokenizer: Any, pacing: Pacing | None = None):
        from areal_libra.server.batching import BatchEngine, EngineConfig

        self.args = args
        self.tokenizer = tokenizer
        self.tokenizer_path = args.model_path
        self.gc_stats: dict[str, float] = {"collections": 0, "freed_objects": 0, "seconds": 0.0}
        self.pacing = pacing
        self.engine = BatchEngine(
            model,
            tokenizer,
            EngineConfig(
                max_running_requests=args.max_running_requests,
                max_total_tokens=args.max_total_tokens,
                prefix_cache_tokens=args.prefix_cache_tokens,
                seed=args.seed,
            ),
            weight_version=args.weight_version,
            pacer=None if pacing is None else pacing.pacer(lambda: self.engine.weight_version),
        )
        self.started_at = time.time()
        self.max_token_chars = max((len(t) for t in tokenizer.get_vocab()), default=1)
        self._update_lock = asyncio.Lock()

    # --------------------------------------------------------------- app
    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        r.add_get("/get_model_info", self.get_model_info)
        r.add_get("/model_info", self.get_model_info)
        r.add_get("/get_server_info", self.get_server_info)
        r.add_get("/server_info", self.get_server_info)
        r.add_get("/get_weight_version", self.get_weight_version)
        r.add_route("GET", "/flush_cache", self.flush_cache)
        r.add_route("POST", "/flush_cache", self.flush_cache)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/release_memory_occupation", self.memory_noop)
        r.add_post("/resume_memory_occupation", self.memory_noop)
        r.add_post("/init_weights_update_group", self.not_on_cpu)
        r.add_post("/update_weights_from_distributed", self.not_on_cpu)
        r.add_post("/update_weights_from_tensor", self.not_on_cpu)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        self.engine.start()

    async def _on_cleanup(self, app: web.Application) -> None:
        self.engine.stop()

    async def _engine_call(self, fn: Any) -> Any:
        return await asyncio.wrap_future(self.engine.call(fn))

    # --------------------------------------------------------------- generate
    async def generate(self, request: web.Request) -> web.Response:
        from areal_libra.server.batching import Request

        try:
            body = await _json_body(request, allow_empty=False)
            gi = parse_generate(body, self.args.default_max_new_tokens)
            vocab = self.engine.vocab_size
            ctx = self.engine.context_len
            if gi.input_ids is not None:
                ids = gi.input_ids
            else:
                ids = await self._tokenize(gi.text, ctx)
            if len(ids) >= ctx:  # checked first: a huge input is refused without a scan over it
                raise RequestError(
                    f"The input ({len(ids)} tokens) is longer than the model's context length ({ctx} tokens)."
                )
            bad = next((t for t in ids if t < 0 or t >= vocab), None)
            if bad is not None:
                raise RequestError(f"input_ids contains token id {short(bad)} outside the vocabulary [0, {vocab})")
            bad_stop = next((t for t in gi.params.stop_token_ids if t < 0 or t >= vocab), None)
            if bad_stop is not None:
                raise RequestError(f"stop_token_ids contains {short(bad_stop)}, outside the vocabulary [0, {vocab})")
        except RequestError as e:
            return _error(str(e))
        gi.params.max_new_tokens = min(gi.params.max_new_tokens, ctx - len(ids))
        t0 = time.perf_counter()
        if gi.params.max_new_tokens == 0:
            req = Request(rid=gi.rid, input_ids=list(ids), params=gi.params, on_finish=lambda r: None)
            req.finish_reason = {"type": "length", "length": 0}
            req.weight_version = self.engine.weight_version
            return web.json_response(self._response(req, gi.return_logprob, t0))

        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def on_finish(r: Request) -> None:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(r))

        req = Request(rid=gi.rid, input_ids=list(ids), params=gi.params, on_finish=on_finish, priority=gi.priority)
        req.logprob_start_len = gi.logprob_start_len
        self.engine.submit(req)
        try:
            # aiohttp does not cancel handlers when the client goes away, so watch the connection.
            while not fut.done():
                await asyncio.wait({fut}, timeout=0.5)
                if not fut.done() and (request.transport is None or request.transport.is_closing()):
                    raise asyncio.CancelledError
        except asyncio.CancelledError:
            # The client went away (timeout, cancelled task): free its batch slot.
            self.engine.call(lambda: self.engine.abort(gi.rid, "Client disconnected"))
            raise
        return web.json_response(self._response(fut.result(), gi.return_logprob, t0))

    async def _tokenize(self, text: str, ctx: int) -> list[int]:
        # No token spells more than max_token_chars characters, so a longer text cannot fit the context;
        # it is refused without tokenizing (5 MB of text took ~50 s and blocked every other request).
        if len(text) > 2 * ctx * self.max_token_chars:
            raise RequestError(
                f"The input ({len(text)} characters) is longer than the model's context length ({ctx} tokens)."
            )
        if len(text) <= 4096:
            return self.tokenizer.encode(text)
        return await asyncio.get_running_loop().run_in_executor(None, self.tokenizer.encode, text)

    def _response(self, req: Any, return_logprob: bool, t0: float) -> dict[str, Any]:
        reason = req.finish_reason or {"type": "abort", "message": "unknown"}
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": reason,
            "prompt_tokens": len(req.input_ids),
            "weight_version": req.weight_version,
            "total_retractions": req.retractions,
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
            "e2e_latency": time.perf_counter() - t0,
        }
        if return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(req.output_logprobs, req.output_ids)]
            if req.input_logprobs is not None:
                toks = req.input_ids[len(req.input_ids) - len(req.input_logprobs) :]
                meta["input_token_logprobs"] = [[lp, t, None] for lp, t in zip(req.input_logprobs, toks)]
        return {
            "text": finish_text(self.tokenizer, req.output_ids, req.params, reason),
            "output_ids": list(req.output_ids),
            "meta_info": meta,
        }

    # --------------------------------------------------------------- health/info
    async def health(self, request: web.Request) -> web.Response:
        t = self.engine._thread
        if t is None or not t.is_alive():
            return web.Response(status=503)
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        from areal_libra.server.batching import Request, SamplingParams

        if self.engine.paused:
            return web.Response(status=200)  # alive; generation is held on purpose
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        req = Request(
            rid=f"HEALTH_CHECK_{time.time_ns()}",
            input_ids=[0],
            params=SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True),
            on_finish=lambda r: loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(r)),
        )
        self.engine.submit(req)
        try:
            await asyncio.wait_for(fut, timeout=20)
        except TimeoutError:
            return web.Response(status=503)
        return web.Response(status=200)

    async def get_model_info(self, request: web.Request) -> web.Response:
        c = self.engine.model.config
        return web.json_response(
            {
                "model_path": self.args.model_path,
                "tokenizer_path": self.tokenizer_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.engine.weight_version,
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": getattr(c, "model_type", None),
                "architectures": getattr(c, "architectures", None),
            }
        )

    def server_info(self) -> dict[str, Any]:
        eng = self.engine
        stats = asdict(eng.stats)
        info: dict[str, Any] = {
            "model_path": self.args.model_path,
            "tokenizer_path": self.tokenizer_path,
            "host": self.args.host,
            "port": self.args.port,
            "tp_size": self.args.tp_size,
            "dp_size": 1,
            "max_running_requests": self.args.max_running_requests,
            "max_total_tokens": self.args.max_total_tokens,
            "prefix_cache_tokens": self.args.prefix_cache_tokens,
            "context_length": eng.context_len,
            "random_seed": self.args.seed,
            "threads": self.args.threads,
            "device": "cpu",
            "backend": "embedded",
            "max_total_num_tokens": self.args.max_total_tokens,
            "version": SERVER_VERSION,
            "weight_version": eng.weight_version,
            "uptime_s": time.time() - self.started_at,
            "paused": eng.paused,
            "num_running_requests": eng.num_running(),
            "num_waiting_requests": eng.num_waiting(),
            "num_used_tokens": eng.num_used_tokens(),
            "kv_cache_bytes": eng.cache.nbytes(),
        }
        info["engine_stats"] = stats
        info["gc_after_update"] = dict(self.gc_stats)
        if memory_debug.ENABLED:
            info["memory_debug"] = memory_debug.snapshot(eng)
        if self.pacing is not None:
            n = stats["paced_iterations"]
            info["emulation"] = {
                **self.pacing.describe(),
                "overrun_fraction": stats["pace_overruns"] / n if n else 0.0,
                # the server's own per-iteration timing: [kind, batch, tokens, measured_s, target_s, compute_s]
                "recent": [list(x) for x in list(eng.pace_log)[-64:]],
            }
        info["internal_states"] = [
            {
                **stats,
                "last_gen_throughput": stats["generated_tokens"] / stats["busy_seconds"]
                if stats["busy_seconds"]
                else 0.0,
            }
        ]
        return info

    async def get_server_info(self, request: web.Request) -> web.Response:
        return web.json_response(self.server_info())

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.engine.weight_version})

    # --------------------------------------------------------------- control
    async def flush_cache(self, request: web.Request) -> web.Response:
        ok = await self._engine_call(self.engine.flush_cache)
        return web.Response(text=FLUSH_TEXT, status=200 if ok else 400, content_type="text/plain")

    async def pause_generation(self, request: web.Request) -> web.Response:
        try:
            body = await _json_body(request)
            _check_fields(body, {"mode"}, "/pause_generation")
            mode = body.get("mode")
            if mode is None:
                mode = "abort"
            if not isinstance(mode, str) or mode not in ("abort", "retract", "in_place"):
                raise RequestError(f"mode must be one of abort, retract, in_place; got {short(mode)}")
        except RequestError as e:
            return _error(str(e))
        await self._engine_call(lambda: self.engine.pause(mode))
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        try:
            _check_fields(await _json_body(request), set(), "/continue_generation")
        except RequestError as e:
            return _error(str(e))
        await self._engine_call(self.engine.resume)
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            body = await _json_body(request)
            _check_fields(body, {"rid", "abort_all", "finished_reason", "abort_message"}, "/abort_request")
            rid, abort_all = body.get("rid"), _opt_bool(body, "abort_all")
            if rid is None:
                rid = ""
            if not isinstance(rid, str):
                raise RequestError(f"rid must be a string, got {short(rid)}")
        except RequestError as e:
            return _error(str(e))
        if abort_all:
            await self._engine_call(lambda: self.engine.abort(None))
        elif rid:
            await self._engine_call(lambda: self.engine.abort(rid))
        return web.Response(status=200)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        allowed = {
            "model_path",
            "load_format",
            "abort_all_requests",
            "weight_version",
            "is_async",
            "torch_empty_cache",
            "keep_pause",
            "recapture_cuda_graph",
            "token_step",
            "flush_cache",
        }
        try:
            body = await _json_body(request, allow_empty=False)
            _check_fields(body, allowed, "/update_weights_from_disk")
            path = body.get("model_path")
            if not isinstance(path, str) or not path or "\x00" in path:
                raise RequestError("model_path must be a non-empty string")
            fmt = body.get("load_format")
            if fmt is not None and (not isinstance(fmt, str) or fmt not in ("auto", "safetensors", "pt")):
                raise RequestError(f"load_format {short(fmt)} is not supported")
            for key in ("abort_all_requests", "is_async", "torch_empty_cache", "keep_pause", "recapture_cuda_graph",
                        "flush_cache"):
                _opt_bool(body, key)
            version = body.get("weight_version")
            if version is not None and (isinstance(version, bool) or not isinstance(version, str | int)):
                raise RequestError(f"weight_version must be a string, got {short(version)}")
        except RequestError as e:
            return web.json_response({"success": False, "message": str(e), "num_paused_requests": 0}, status=400)

        async with self._update_lock:
            try:
                model, _ = await asyncio.get_running_loop().run_in_executor(None, load_model, path)
            except Exception as e:  # a bad path or checkpoint: report it, keep serving the old weights
                msg = f"Failed to load weights from {path}: {type(e).__name__}: {e}"
                return web.json_response({"success": False, "message": msg, "num_paused_requests": 0}, status=400)
            if _shape_signature(model) != _shape_signature(self.engine.model):
                msg = f"Checkpoint at {path} has a different architecture/shape than the served model"
                return web.json_response({"success": False, "message": msg, "num_paused_requests": 0}, status=400)
            if body.get("abort_all_requests"):
                await self._engine_call(lambda: self.engine.abort(None, "Aborted by update_weights_from_disk"))
            wv = None if version is None else str(version)
            if wv is None:
                # AReaL 1.0.4 sends no weight_version; its disk updates are versioned directories
                # (WeightUpdateMeta.with_version: weight_update_v<N>). Report that version, so responses and an
                # emulated server's length growth follow the trainer's.
                m = _VERSIONED_PATH.search(os.path.basename(path.rstrip("/")))
                wv = m.group(1) if m else None
            n = await self._engine_call(lambda: self.engine.set_model(model, wv))
            self.args.model_path = path
            # Request state that lived through a step reaches the oldest generation, whose automatic
            # collection is rare: its cycles (and the tensors they hold) would pile up for minutes.
            t0 = time.perf_counter()
            self.gc_stats["freed_objects"] += gc.collect()
            self.gc_stats["collections"] += 1
            self.gc_stats["seconds"] += time.perf_counter() - t0
        return web.json_response(
            {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": n}
        )

    async def memory_noop(self, request: web.Request) -> web.Response:
        try:
            await _json_body(request)  # SGLang's bodies (tags) have no meaning here, but must be JSON
        except RequestError as e:
            return web.json_response({"success": False, "message": str(e)}, status=400)
        return web.json_response({"success": True, "message": "No-op on the embedded CPU server."})

    async def not_on_cpu(self, request: web.Request) -> web.Response:
        msg = (
            f"{request.path} needs SGLang on GPUs (NCCL); the embedded CPU server only supports "
            "weight updates from disk (actor.weight_update_mode=disk)"
        )
        return web.json_response({"success": False, "message": msg}, status=400)


# ------------------------------------------------------------------- CLI
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump
        sys.stderr.write(f"embedded_server: error: {message}\n")
        raise SystemExit(2)


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    p = _Parser(prog="python -m areal_libra.server.embedded_server", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--max-running-requests", type=int, default=128)
    p.add_argument("--threads", type=int, default=None, help="intra-op compute threads (default: --tp-size)")
    p.add_argument("--max-total-tokens", type=int, default=262144)
    p.add_argument("--prefix-cache-tokens", type=int, default=32768, help="0 disables reuse across turns")
    p.add_argument("--seed", "--random-seed", dest="seed", type=int, default=0)
    p.add_argument("--default-max-new-tokens", type=int, default=128)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process has gone")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    ns = p.parse_args(argv)
    if ns.threads is None:
        ns.threads = ns.tp_size
    for name in ("tp_size", "max_running_requests", "threads", "max_total_tokens", "default_max_new_tokens"):
        if getattr(ns, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(ns, name)}")
    if ns.prefix_cache_tokens < 0:
        p.error(f"--prefix-cache-tokens must be >= 0, got {ns.prefix_cache_tokens}")
    if not 0 < ns.port < 65536:
        p.error(f"--port must be in 1..65535, got {ns.port}")
    if not os.path.isfile(os.path.join(ns.model_path, "config.json")):
        sys.stderr.write(
            f"embedded_server: error: --model-path {ns.model_path!r} is not a Hugging Face model directory (no config.json)\n"
        )
        raise SystemExit(1)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = ServerArgs(
        model_path=ns.model_path,
        host=ns.host,
        port=ns.port,
        tp_size=ns.tp_size,
        max_running_requests=ns.max_running_requests,
        threads=ns.threads,
        max_total_tokens=ns.max_total_tokens,
        prefix_cache_tokens=ns.prefix_cache_tokens,
        seed=ns.seed,
        default_max_new_tokens=ns.default_max_new_tokens,
        weight_version=ns.weight_version,
        parent_pid=ns.parent_pid,
    )
    return args


async def _watch_parent(pid: int, stop: asyncio.Event) -> None:
    """Servers run in their own session (so they can be killed as a group); without this, a launcher that
    crashes would leave them running forever."""
    while pid_alive(pid) and os.getppid() != 1:
        await asyncio.sleep(1.0)
    logger.warning("parent process %d is gone; shutting down", pid)
    stop.set()


async def _serve(server: EmbeddedServer) -> None:
    import signal

    runner = web.AppRunner(server.app(), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, server.args.host, server.args.port, reuse_address=True, backlog=4096)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watchdog = None
    if server.args.parent_pid is not None:
        watchdog = asyncio.create_task(_watch_parent(server.args.parent_pid, stop))
    try:
        await site.start()
        print(f"embedded_server ready on http://{server.args.host}:{server.args.port}", flush=True)
        await stop.wait()
        if watchdog is not None:
            watchdog.cancel()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


def run(args: ServerArgs, pacing: Pacing | None = None) -> int:
    """Serve until SIGTERM/SIGINT (or the parent process is gone); the process exit code."""
    # Idle OpenMP workers sleep rather than spin (must be set before torch starts its pool): spinning
    # workers of a multi-threaded server starve the other processes of a shared CPU.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    torch.set_num_threads(args.threads)
    # The HTTP thread must get the GIL between engine steps often enough to take in a burst of requests
    # (default 5 ms would let requests trickle into the batch over many decode steps).
    sys.setswitchinterval(0.0005)
    try:
        model, tokenizer = load_model(args.model_path)
    except Exception as e:
        sys.stderr.write(f"embedded_server: error: cannot load model from {args.model_path}: {e}\n")
        return 1
    server = EmbeddedServer(args, model, tokenizer, pacing)
    # The ~400k objects of torch/transformers/the model live as long as the server: out of the collector's
    # sight, a full collection (after each weight update) scans only what serving allocated.
    gc.freeze()
    try:
        asyncio.run(_serve(server))
    except OSError as e:
        sys.stderr.write(f"embedded_server: error: cannot listen on {args.host}:{args.port}: {e}\n")
        return 1
    except (KeyboardInterrupt, asyncio.CancelledError):
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
