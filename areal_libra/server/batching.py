"""Continuous-batching generation engine for a Hugging Face causal LM on CPU.

One engine thread owns the model. Between decode steps it runs control commands (abort, pause, weight
reload), admits waiting requests (one batched prefill; identical prompts are prefilled once), and then
runs one batched decode step over every running request with the shared KV cache (kv_cache.SlotKVCache).
Other threads talk to it only through thread-safe methods; results come back through each request's
``on_finish`` callback, called on the engine thread.
"""

from __future__ import annotations

import collections
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from areal_libra.cmlfq.aging import edf_insert
from areal_libra.server.attention import use_gqa_attention
from areal_libra.server.kv_cache import PrefixCache, SlotKVCache
from areal_libra.server.protocol import SamplingParams
from areal_libra.server.sampling import SamplingBatch, sample

logger = logging.getLogger("areal_libra.server")

ABORT_BEFORE_PREFILL = "Abort before prefill"  # AReaL's client treats this prefix as "no tokens"
# Distinct stop-string sets whose candidate tokens are kept (least recently used beyond): each holds up to a
# vocabulary of ids, and clients may send a different set with every request.
STOP_CANDIDATE_CACHE = 64


def _priority(req: Request) -> int:
    return sys.maxsize if req.priority is None else req.priority


def _finished(req: Request) -> None:
    """A finished request's callback: it has been called already."""


@dataclass
class Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    on_finish: Callable[[Request], None]
    seed: int = 0
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    cached_tokens: int = 0
    retractions: int = 0
    logprob_start_len: int = -1  # >= 0: also score the prompt tokens from this position (SGLang semantics)
    input_logprobs: list[float | None] | None = None
    arrival: float = field(default_factory=time.perf_counter)
    finished_at: float = 0.0
    weight_version: str = "default"
    priority: int | None = None  # lower is admitted first (FIFO among equals); None: after all prioritised
    # engine-private
    stop_ids: frozenset[int] = frozenset()
    stop_candidates: frozenset[int] | None = None  # tokens that may complete a stop string; None = all
    max_stop_len: int = 0


@dataclass
class EngineConfig:
    max_running_requests: int = 128
    max_total_tokens: int = 262144
    max_prefill_tokens: int = 16384  # padded tokens per prefill forward
    prefix_cache_tokens: int = 32768  # 0 disables reuse of finished sequences' keys/values
    seed: int = 0
    compact_dead_fraction: float = 0.25
    compact_padding_fraction: float = 0.5


class Pacer(Protocol):
    """Target wall times for an emulated accelerator (areal_libra.rollout.emulation.ServerEmulation):
    the engine sleeps until each iteration has taken its target."""

    def decode_s(self, batch: int, resident_tokens: int) -> float: ...

    def prefill_s(self, chunks: Iterable[tuple[int, int]]) -> float: ...


@dataclass
class EngineStats:
    decode_steps: int = 0
    prefill_forwards: int = 0
    generated_tokens: int = 0
    prefill_tokens: int = 0
    cached_tokens: int = 0
    max_batch_seen: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0
    retracted_requests: int = 0
    compactions: int = 0
    busy_seconds: float = 0.0
    decode_seconds: float = 0.0  # wall time of decode iterations (with pacing sleep, if paced)
    prefill_seconds: float = 0.0
    # pacing (emulated accelerators): iterations paced, those whose own compute exceeded the target
    paced_iterations: int = 0
    pace_overruns: int = 0
    pace_target_seconds: float = 0.0
    pace_sleep_seconds: float = 0.0
    paced_decode_iterations: int = 0  # decode alone: prefill targets are milliseconds and overrun often
    pace_decode_overruns: int = 0


class BatchEngine:
    """Owns the model; serves requests with continuous batching on its own thread."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        config: EngineConfig,
        weight_version: str = "default",
        pacer: Pacer | None = None,
    ):
        self.cfg = config
        self.pacer = pacer
        # (kind, batch, tokens, measured_s, target_s, compute_s) of recent paced iterations: the server's own
        # timing (measured = compute + pacing sleep)
        self.pace_log: collections.deque[tuple[str, int, int, float, float, float]] = collections.deque(maxlen=256)
        self.tokenizer = tokenizer
        self.weight_version = weight_version
        self.stats = EngineStats()
        self._cv = threading.Condition()
        self._inbox: list[Request] = []
        self._commands: list[tuple[Callable[[], Any], Future]] = []
        self._waiting: collections.deque[Request] = collections.deque()
        self._paused = False
        self._stopping = False
        self._seed_counter = 0
        self._thread: threading.Thread | None = None
        self._vocab_texts: list[str] | None = None
        self._candidate_cache: collections.OrderedDict[tuple[str, ...], frozenset[int] | None] = (
            collections.OrderedDict()
        )
        self.prefix_cache = PrefixCache(config.prefix_cache_tokens) if config.prefix_cache_tokens > 0 else None
        self._set_model(model)

    # ------------------------------------------------------------------ model
    def _set_model(self, model: torch.nn.Module) -> None:
        model.eval()
        self.gqa_attention = use_gqa_attention(model)
        cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
        self.model = model
        self.model_config = cfg
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        self.context_len = int(getattr(cfg, "max_position_embeddings", 32768))
        self.layer_types = sorted(set(getattr(cfg, "layer_types", None) or ["full_attention"]))
        dtype = next(model.parameters()).dtype
        self._new_cache = lambda: SlotKVCache(cfg.num_hidden_layers, kv_heads, head_dim, dtype)
        self.eos_ids = self._eos_ids(model, self.tokenizer)
        if self.prefix_cache is not None:
            self.prefix_cache.clear()  # keys/values of other weights
        self._reset_batch()

    @staticmethod
    def _eos_ids(model: torch.nn.Module, tokenizer: Any) -> frozenset[int]:
        ids: set[int] = set()
        for src in (getattr(model, "generation_config", None), model.config):
            e = getattr(src, "eos_token_id", None) if src is not None else None
            if isinstance(e, int):
                ids.add(e)
            elif isinstance(e, list | tuple):
                ids.update(int(x) for x in e)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            ids.add(int(tokenizer.eos_token_id))
        return frozenset(ids)

    def _reset_batch(self) -> None:
        self.cache = self._new_cache()
        self.row_req: list[Request | None] = []
        self._n_live = 0  # running requests (rows with a request)
        self._held = 0  # tokens (prompt + output) of the running requests
        self._freed = False  # a row was freed since the last compaction check
        if getattr(self, "_last_tok", None) is None or self._counts.shape[1] not in (1, self.vocab_size):
            self._last_tok = None
            self._alloc_row_state(16)

    def _alloc_row_state(self, rows: int) -> None:
        old = getattr(self, "_last_tok", None)
        n_old = 0 if old is None else min(old.shape[0], rows)

        def grow(t: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, fill: float = 0) -> torch.Tensor:
            nt = torch.full(shape, fill, dtype=dtype)
            if t is not None:
                nt[:n_old] = t[:n_old]
            return nt

        self._last_tok = grow(old, (rows,), torch.long)
        self._pos = grow(getattr(self, "_pos", None), (rows,), torch.long)
        self._temp = grow(getattr(self, "_temp", None), (rows,), torch.float32, 1.0)
        self._top_p = grow(getattr(self, "_top_p", None), (rows,), torch.float32, 1.0)
        self._top_k = grow(getattr(self, "_top_k", None), (rows,), torch.long, -1)
        self._seed = grow(getattr(self, "_seed", None), (rows,), torch.long)
        self._ntok = grow(getattr(self, "_ntok", None), (rows,), torch.long)
        self._freq = grow(getattr(self, "_freq", None), (rows,), torch.float32)
        self._pres = grow(getattr(self, "_pres", None), (rows,), torch.float32)
        # Output-token counts for frequency/presence penalties: one column until a request uses them
        # (a [rows, vocab] table is large for real vocabularies).
        counts = getattr(self, "_counts", None)
        width = 1 if counts is None or n_old == 0 else counts.shape[1]
        self._counts = grow(counts if width > 1 else None, (rows, width), torch.float32)

    # ------------------------------------------------------------ thread API
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def submit(self, req: Request) -> None:
        with self._cv:
            if req.params.sampling_seed is not None:
                # The sampler hashes the low 32 bits only; reducing here keeps any JSON integer (even
                # beyond int64) from failing the whole batch's step when it is stored in a tensor.
                req.seed = int(req.params.sampling_seed) & 0xFFFFFFFF
            else:
                self._seed_counter += 1
                req.seed = (self.cfg.seed * 1_000_003 + self._seed_counter) & 0xFFFFFFFF
            self._inbox.append(req)
            self._cv.notify_all()

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the engine thread between steps (works while paused)."""
        fut: Future = Future()
        with self._cv:
            self._commands.append((fn, fut))
            self._cv.notify_all()
        return fut

    @property
    def paused(self) -> bool:
        return self._paused

    def num_running(self) -> int:
        return self._n_live

    def num_waiting(self) -> int:
        return len(self._waiting) + len(self._inbox)

    def num_used_tokens(self) -> int:
        """KV-cache tokens held by the running requests (of max_total_tokens): the KV side of pressure."""
        return self._held

    # The following run on the engine thread (use ``call``).
    def pause(self, mode: str) -> int:
        """Stop scheduling. abort: running and queued requests return now with their tokens so far;
        retract: running requests drop their KV cache and wait to be re-prefilled; in_place: they keep it."""
        self._paused = True
        if mode == "abort":
            return self.abort(None, "Aborted by pause_generation")
        if mode == "retract":
            return self._retract_all()
        return self.num_running()

    def resume(self) -> None:
        self._paused = False

    def abort(self, rid: str | None, message: str = "Aborted by abort_request") -> int:
        """Abort one request (by rid) or all (rid None). Returns how many were aborted."""
        n = 0
        self._drain_inbox()
        keep: collections.deque[Request] = collections.deque()
        for req in self._waiting:
            if rid is None or req.rid == rid:
                msg = message if req.output_ids else f"{ABORT_BEFORE_PREFILL}: {message}"
                self._finish(req, {"type": "abort", "message": msg})
                n += 1
            else:
                keep.append(req)
        self._waiting = keep
        for row, req in enumerate(self.row_req):
            if req is not None and (rid is None or req.rid == rid):
                self._finish(req, {"type": "abort", "message": message})
                self._keep_prefix(row, req)
                self._free_row(row)
                n += 1
        self.stats.aborted_requests += n
        return n

    def set_model(self, model: torch.nn.Module, weight_version: str | None) -> int:
        """Swap the weights. Running requests keep their tokens but are re-prefilled with the new
        weights (their KV cache was computed by the old ones). Returns how many were running."""
        n = self._retract_all()
        self._set_model(model)
        if weight_version is not None:
            self.weight_version = weight_version
        return n

    def flush_cache(self) -> bool:
        """Drop cached state; refused (False) while requests run, as SGLang does."""
        if self.num_running() or self._waiting or self._inbox:
            return False
        self._reset_batch()
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        return True

    # ------------------------------------------------------------ the loop
    def _drain_inbox(self) -> None:
        with self._cv:
            inbox, self._inbox = self._inbox, []
        for req in inbox:  # SGLang's priority scheduling: lowest value first, arrival order on ties
            edf_insert(self._waiting, req, _priority(req), _priority)

    def _loop(self) -> None:
        # Everything the engine thread does (steps and commands) touches inference-mode tensors.
        with torch.inference_mode():
            self._run()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (
                    self._stopping
                    or self._commands
                    or (not self._paused and (self._inbox or self._waiting or self.num_running()))
                ):
                    self._cv.wait()
                if self._stopping:
                    break
                commands, self._commands = self._commands, []
            for fn, fut in commands:
                try:
                    fut.set_result(fn())
                except Exception as e:  # the caller reports it; the engine keeps serving
                    fut.set_exception(e)
            if self._paused:
                continue
            t0 = time.perf_counter()
            try:
                self._drain_inbox()
                self._admit()
                if self.num_running():
                    self._decode_step()
            except Exception:
                logger.exception("engine step failed; aborting running requests")
                self.abort(None, "Internal engine error")
                self._reset_batch()
            self.stats.busy_seconds += time.perf_counter() - t0

    # ------------------------------------------------------------ scheduling
    def _admit(self) -> None:
        if not self._waiting:
            return
        running = self.num_running()
        held = self._held
        batch: list[Request] = []
        padded_max = 0
        while self._waiting and running + len(batch) < self.cfg.max_running_requests:
            req = self._waiting[0]
            n = len(req.input_ids) + len(req.output_ids)
            if held + n + 1 > self.cfg.max_total_tokens and (running or batch):
                break  # wait for memory; a lone request is always admitted
            if batch and max(padded_max, n) * (len(batch) + 1) > self.cfg.max_prefill_tokens:
                break
            self._waiting.popleft()
            batch.append(req)
            held += n
            padded_max = max(padded_max, n)
        if batch:
            self._prefill(batch)

    def _prepare(self, req: Request) -> None:
        p = req.params
        req.stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_ids)
        req.max_stop_len = max((len(s) for s in p.stop), default=0)
        req.stop_candidates = self._stop_candidates(tuple(p.stop)) if p.stop else frozenset()

    def _stop_candidates(self, stops: tuple[str, ...]) -> frozenset[int] | None:
        """Token ids whose text may complete one of ``stops``: the expensive tail decode runs only when
        such a token is sampled. None means every token is a candidate."""
        if stops in self._candidate_cache:
            self._candidate_cache.move_to_end(stops)
            return self._candidate_cache[stops]
        if self._vocab_texts is None:
            self._vocab_texts = [self.tokenizer.decode([i]) for i in range(self.vocab_size)]
        lasts = {s[-1] for s in stops if s}
        result: frozenset[int] | None
        if any(ch.isspace() for ch in lasts):
            result = None  # tokenizers may drop leading/trailing spaces of a lone token
        else:
            result = frozenset(
                i for i, t in enumerate(self._vocab_texts) if "\ufffd" in t or not t or any(ch in t for ch in lasts)
            )
        self._candidate_cache[stops] = result
        while len(self._candidate_cache) > STOP_CANDIDATE_CACHE:
            self._candidate_cache.popitem(last=False)
        return result

    def _free_rows(self, n: int) -> list[int]:
        """Dead rows first (no cache movement), then new rows appended to the buffers."""
        rows = [i for i, r in enumerate(self.row_req) if r is None][:n]
        missing = n - len(rows)
        if missing:
            first = self.cache.add_rows(missing)
            rows += list(range(first, first + missing))
            self.row_req.extend([None] * missing)
            if self.cache.rows > self._last_tok.shape[0]:
                self._alloc_row_state(max(self.cache.rows, 2 * self._last_tok.shape[0]))
        return rows

    def _keep_prefix(self, row: int, req: Request) -> None:
        """Offer a leaving request's keys/values to the prefix cache. The cache holds every token but the
        last sampled one (never fed back), right-aligned at the write column."""
        if self.prefix_cache is None:
            return
        seq = (req.input_ids + req.output_ids)[:-1]
        n, end = len(seq), self.cache.length
        if n < 4 or n > end:
            return
        self.prefix_cache.put(
            tuple(seq),
            [k[row, :, end - n : end] for k in self.cache.keys],
            [v[row, :, end - n : end] for v in self.cache.values],
        )

    def _free_row(self, row: int) -> None:
        req = self.row_req[row]
        if req is not None:
            self._n_live -= 1
            self._held -= len(req.input_ids) + len(req.output_ids)
            self._freed = True
        self.row_req[row] = None
        self.cache.clear_row(row)

    def _forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask4d: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        """Logits [B, V] of the last position (the decode step)."""
        masks = dict.fromkeys(self.layer_types, mask4d)
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=masks,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :]

    @torch.inference_mode()
    def _prefill(self, reqs: list[Request]) -> None:
        """One batched forward for newly admitted requests: identical sequences are computed once, and a
        sequence that extends a cached one (the previous turn of a multi-turn agent) prefills only its
        new tail on top of the cached keys/values. Suffixes are right-padded after the right-aligned
        prefixes, so each sequence's keys are contiguous in the temporary cache."""
        t0 = time.perf_counter()
        for r in reqs:
            self._prepare(r)
        seqs = [tuple(r.input_ids + r.output_ids) for r in reqs]
        uniq: dict[tuple[int, ...], int] = {}
        for s in seqs:
            uniq.setdefault(s, len(uniq))
        useqs = list(uniq)
        n = len(useqs)
        scoring = {uniq[s] for r, s in zip(reqs, seqs) if r.logprob_start_len >= 0 and r.input_logprobs is None}
        hits = [
            None if (u in scoring or self.prefix_cache is None) else self.prefix_cache.match(s)
            for u, s in enumerate(useqs)
        ]
        plens = [h[0] if h else 0 for h in hits]
        slens = [len(s) - p for s, p in zip(useqs, plens)]
        pmax, smax = max(plens), max(slens)

        tmp = self._new_cache()
        tmp.add_rows(n)
        tmp.widen_to(pmax)
        for u, h in enumerate(hits):
            if h is not None:
                tmp.place(u, h[1], h[2])
        tmp.ensure_step_room(smax)
        ids = torch.zeros(n, smax, dtype=torch.long)
        for u, (s, p) in enumerate(zip(useqs, plens)):
            ids[u, : len(s) - p] = torch.tensor(s[p:], dtype=torch.long)
        pos = torch.tensor(plens)[:, None] + torch.arange(smax)[None, :]
        causal = torch.ones(smax, smax, dtype=torch.bool).tril()
        # Prefix columns: the row's cached tokens; suffix columns: causal. No mask row is empty (the
        # diagonal), so padding queries cannot produce NaNs.
        mask4d = torch.cat([tmp.mask[:n, None, :pmax].expand(n, smax, pmax), causal.expand(n, smax, smax)], dim=-1)
        hidden = self._hidden(ids, pos, mask4d[:, None], tmp)
        last = hidden[torch.arange(n), torch.tensor(slens) - 1]
        logits = self.model.get_output_embeddings()(last)
        for r in reqs:
            if r.logprob_start_len >= 0 and r.input_logprobs is None:
                self._score_prompt(r, hidden[uniq[tuple(r.input_ids + r.output_ids)]])
        self.stats.prefill_forwards += 1
        self.stats.prefill_tokens += sum(slens)

        rows = self._free_rows(len(reqs))
        self.cache.widen_to(max(len(s) for s in useqs))
        self.cache.ensure_step_room(1)
        seen: set[int] = set()
        for req, row, s in zip(reqs, rows, seqs):
            u = uniq[s]
            reused = len(s) if u in seen else plens[u]
            req.cached_tokens += reused
            self.stats.cached_tokens += reused
            seen.add(u)
            ln = len(s)
            lo, hi = pmax - plens[u], pmax + slens[u]
            self.cache.place(row, [k[u, :, lo:hi] for k in tmp.keys], [v[u, :, lo:hi] for v in tmp.values])
            self.row_req[row] = req
            self._n_live += 1
            self._held += ln
            self._pos[row] = ln
            self._ntok[row] = len(req.output_ids)
            p = req.params
            self._temp[row] = p.temperature
            self._top_p[row] = p.top_p
            self._top_k[row] = min(p.top_k, self.vocab_size)  # > vocab means all; must fit int64
            self._seed[row] = req.seed
            self._freq[row] = p.frequency_penalty
            self._pres[row] = p.presence_penalty
            if (p.frequency_penalty or p.presence_penalty) and self._counts.shape[1] == 1:
                self._counts = torch.zeros(self._counts.shape[0], self.vocab_size)
            self._counts[row] = 0
            if req.output_ids and (p.frequency_penalty or p.presence_penalty):
                self._counts[row].index_add_(
                    0, torch.tensor(req.output_ids), torch.ones(len(req.output_ids), dtype=torch.float32)
                )
        row_idx = torch.tensor(rows, dtype=torch.long)
        uidx = torch.tensor([uniq[s] for s in seqs], dtype=torch.long)
        self._sample_and_advance(logits.index_select(0, uidx), row_idx)
        if self.pacer is not None:
            self._pace("prefill", t0, n, sum(slens), self.pacer.prefill_s(zip(slens, plens)))
        self.stats.prefill_seconds += time.perf_counter() - t0

    def _hidden(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask4d: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        """Final hidden states [B, T, H] of the decoder (the LM head is applied only where needed)."""
        masks = dict.fromkeys(self.layer_types, mask4d)
        out = self.model.get_decoder()(
            input_ids=input_ids, position_ids=position_ids, attention_mask=masks, past_key_values=cache, use_cache=True
        )
        return out.last_hidden_state

    def _score_prompt(self, r: Request, hidden: torch.Tensor) -> None:
        """Prompt-token logprobs (raw logits, as SGLang's input_token_logprobs): entry j is log p(token j |
        tokens before j), None for the first token of the sequence. ``hidden`` is the row's [T, H]."""
        n = len(r.input_ids)
        start = min(r.logprob_start_len, n - 1)
        out: list[float | None] = [None] if start == 0 else []
        lo = max(start, 1)
        if lo < n:
            logits = self.model.get_output_embeddings()(hidden[lo - 1 : n - 1])
            lp = torch.log_softmax(logits.float(), -1)
            out += lp.gather(1, torch.tensor(r.input_ids[lo:n])[:, None]).squeeze(1).tolist()
        r.input_logprobs = out

    def _pace(self, kind: str, t0: float, batch: int, tokens: int, target: float) -> None:
        """Sleep until this iteration (begun at t0) has taken ``target`` seconds: an emulated accelerator
        is as fast as the real one it stands for, never faster. Overruns (own compute > target) are counted."""
        compute = time.perf_counter() - t0
        if compute < target:
            time.sleep(target - compute)
        # Counters and the log change together, after the sleep: a reader sees the same iterations in both.
        st = self.stats
        decode = kind == "decode"
        st.paced_iterations += 1
        st.pace_target_seconds += target
        st.paced_decode_iterations += decode
        if compute >= target:
            st.pace_overruns += 1
            st.pace_decode_overruns += decode
        else:
            st.pace_sleep_seconds += target - compute
        self.pace_log.append((kind, batch, tokens, time.perf_counter() - t0, target, compute))

    @torch.inference_mode()
    def _decode_step(self) -> None:
        t0 = time.perf_counter()
        batch, resident = self._n_live, self._held  # before this step's tokens and finishes
        cache = self.cache
        b = cache.rows
        cache.ensure_step_room(1)
        col = cache.length
        cache.mask[:b, col] = True
        mask4d = cache.mask[:b, : col + 1][:, None, None, :]
        logits = self._forward(self._last_tok[:b, None], self._pos[:b, None], mask4d, cache)
        cache.length = col + 1
        self._pos[:b] += 1
        self.stats.decode_steps += 1
        self.stats.max_batch_seen = max(self.stats.max_batch_seen, self.num_running())
        self._sample_and_advance(logits, None)
        self._maybe_compact()
        self._enforce_token_budget()
        if self.pacer is not None:
            self._pace("decode", t0, batch, resident, self.pacer.decode_s(batch, resident))
        self.stats.decode_seconds += time.perf_counter() - t0

    def _sample_and_advance(self, logits: torch.Tensor, rows: torch.Tensor | None) -> None:
        """Sample the next token for ``rows`` (None = rows 0..B-1), record it, and finish requests."""
        sl = slice(None) if rows is None else rows
        b = logits.shape[0]

        def take(t: torch.Tensor) -> torch.Tensor:
            return t[:b] if rows is None else t.index_select(0, rows)

        counts = None
        freq = pres = None
        fr, pr = take(self._freq), take(self._pres)
        if bool((fr != 0).any()) or bool((pr != 0).any()):
            counts, freq, pres = take(self._counts), fr, pr
        row_list = range(b) if rows is None else rows.tolist()
        counter = take(self._ntok)
        sp = SamplingBatch(
            temperature=take(self._temp),
            top_p=take(self._top_p),
            top_k=take(self._top_k),
            seed=take(self._seed),
            counter=counter,
            frequency_penalty=freq,
            presence_penalty=pres,
            token_counts=counts,
        )
        tok, lp = sample(logits, sp)
        if rows is None:
            self._last_tok[:b] = tok
            self._ntok[:b] += 1
        else:
            self._last_tok[sl] = tok
            self._ntok[sl] += 1
        if counts is not None:
            ri = torch.tensor(list(row_list))
            self._counts.index_put_((ri, tok), torch.ones(b), accumulate=True)
        toks, lps = tok.tolist(), lp.tolist()
        n_new = 0
        for i, row in enumerate(row_list):
            req = self.row_req[row]
            if req is None:
                continue
            t = toks[i]
            req.output_ids.append(t)
            req.output_logprobs.append(lps[i])
            n_new += 1
            reason = self._check_finished(req, t)
            if reason is not None:
                self._finish(req, reason)
                self._keep_prefix(row, req)
                self._free_row(row)
        self.stats.generated_tokens += n_new
        self._held += n_new

    def _check_finished(self, req: Request, tok: int) -> dict[str, Any] | None:
        p = req.params
        if len(req.output_ids) >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        if tok in req.stop_ids:
            return {"type": "stop", "matched": tok}
        if p.stop and (req.stop_candidates is None or tok in req.stop_candidates):
            tail = self.tokenizer.decode(
                req.output_ids[-(req.max_stop_len + 1) :], skip_special_tokens=p.skip_special_tokens
            )
            for s in p.stop:
                if s in tail:
                    return {"type": "stop", "matched": s}
        if len(req.input_ids) + len(req.output_ids) >= self.context_len:
            return {"type": "length", "length": len(req.output_ids)}
        return None

    def _finish(self, req: Request, reason: dict[str, Any]) -> None:
        req.finish_reason = reason
        req.finished_at = time.perf_counter()
        req.weight_version = self.weight_version
        self.stats.finished_requests += 1
        # Called once; dropping it breaks request -> callback -> future -> request, a cycle that would keep
        # every finished request (and its tensors) alive until a rare full collection.
        on_finish, req.on_finish = req.on_finish, _finished
        try:
            on_finish(req)
        except Exception:
            logger.exception("on_finish callback failed for %s", req.rid)

    def _retract_all(self) -> int:
        """Move every running request back to the head of the queue (KV dropped, tokens kept)."""
        running = [(row, r) for row, r in enumerate(self.row_req) if r is not None]
        for row, req in reversed(running):
            req.retractions += 1
            self._waiting.appendleft(req)
            self._free_row(row)
        self.stats.retracted_requests += len(running)
        self._reset_batch()
        return len(running)

    def _enforce_token_budget(self) -> None:
        """If running requests outgrew max_total_tokens, retract the newest ones (SGLang does the same)."""
        while self._n_live > 1 and self._held > self.cfg.max_total_tokens:
            newest = max(
                (row for row, r in enumerate(self.row_req) if r is not None), key=lambda rr: self.row_req[rr].arrival
            )
            req = self.row_req[newest]
            req.retractions += 1
            self.stats.retracted_requests += 1
            self._free_row(newest)
            self._waiting.appendleft(req)

    def _maybe_compact(self) -> None:
        if not self._freed:
            return  # padding and dead rows only grow when a request leaves
        self._freed = False
        live = [i for i, r in enumerate(self.row_req) if r is not None]
        rows = self.cache.rows
        if not live:
            if rows:
                self._reset_batch()
            return
        dead = rows - len(live)
        first = self.cache.first_used_column(live)
        if (
            dead <= self.cfg.compact_dead_fraction * rows
            and first <= self.cfg.compact_padding_fraction * self.cache.length
        ):
            return
        self.stats.compactions += 1
        self.cache.compact(live)
        idx = torch.tensor(live, dtype=torch.long)
        for name in ("_last_tok", "_pos", "_temp", "_top_p", "_top_k", "_seed", "_ntok", "_freq", "_pres", "_counts"):
            t = getattr(self, name)
            nt = torch.zeros_like(t)
            nt[: len(live)] = t.index_select(0, idx)
            setattr(self, name, nt)
        self.row_req = [self.row_req[i] for i in live]
