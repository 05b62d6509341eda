"""The continuous-batching engine without HTTP: staggered arrivals, row reuse, compaction, retraction."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_libra.server.batching import BatchEngine, EngineConfig, Request, SamplingParams
from areal_libra.server.protocol import RequestError, finish_text, parse_generate
from areal_libra.server.sampling import uniforms


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), AutoTokenizer.from_pretrained(
        tiny_model_dir
    )


_REF: dict[str, torch.nn.Module] = {}


def check_logprobs(model, req: Request, temperature: float = 1.0) -> None:
    """Compare with a separately loaded copy using the eager attention (the engine swaps its model's
    attention implementation, so the engine's own model object is no independent reference)."""
    path = model.name_or_path
    if path not in _REF:
        _REF[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        logits = _REF[path](torch.tensor([req.input_ids + req.output_ids])).logits[0, len(req.input_ids) - 1 : -1]
    ref = torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(req.output_ids)[:, None]).squeeze(1)
    assert torch.allclose(ref, torch.tensor(req.output_logprobs), atol=1e-4), req.rid


@contextlib.contextmanager
def running(model, tok, cfg: EngineConfig) -> Iterator[BatchEngine]:
    """A started engine, stopped on exit (its stats stay readable afterwards)."""
    engine = BatchEngine(model, tok, cfg)
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


def run_staggered(engine: BatchEngine, specs: list[tuple[list[int], SamplingParams]], gap: float) -> list[Request]:
    done = threading.Semaphore(0)
    reqs = [
        Request(rid=f"r{i}", input_ids=ids, params=sp, on_finish=lambda r: done.release())
        for i, (ids, sp) in enumerate(specs)
    ]
    for r in reqs:
        engine.submit(r)
        time.sleep(gap)
    for _ in reqs:
        assert done.acquire(timeout=120)
    return reqs


def test_staggered_mixed_lengths_match_unbatched_model(hf):
    """Requests of different prompt lengths join and leave a running batch (row reuse, left-padding,
    compaction, queueing beyond max_running); every logprob equals a plain forward of that sequence."""
    model, tok = hf
    rng = random.Random(0)
    with running(model, tok, EngineConfig(max_running_requests=8, seed=1)) as engine:
        specs = []
        for _ in range(30):
            ids = [rng.randrange(2, len(tok)) for _ in range(rng.randint(1, 50))]
            specs.append((ids, SamplingParams(max_new_tokens=rng.randint(1, 40), ignore_eos=True)))
        reqs = run_staggered(engine, specs, gap=0.003)
    for r, (_, sp) in zip(reqs, specs):
        assert len(r.output_ids) == sp.max_new_tokens and r.finish_reason["type"] == "length"
        check_logprobs(model, r)
    st = engine.stats
    assert st.max_batch_seen == 8  # the cap was reached and respected
    assert st.compactions > 0


def test_identical_prompts_prefilled_once(hf):
    model, tok = hf
    engine = BatchEngine(model, tok, EngineConfig(max_running_requests=16))
    ids = tok.encode("What is 2+2? ")
    for i in range(8):
        engine.submit(
            Request(rid=str(i), input_ids=ids, params=SamplingParams(max_new_tokens=5), on_finish=lambda r: None)
        )
    engine._drain_inbox()
    engine._admit()
    assert engine.stats.prefill_tokens == len(ids) and engine.stats.cached_tokens == 7 * len(ids)
    while engine.num_running():
        engine._decode_step()


def test_token_budget_retracts_and_completes(hf):
    """max_total_tokens smaller than the batch's needs: requests are retracted and re-prefilled, and still
    produce correct continuations."""
    model, tok = hf
    with running(model, tok, EngineConfig(max_running_requests=8, max_total_tokens=200)) as engine:
        specs = [
            (tok.encode(f"What is {i}+{i}? "), SamplingParams(max_new_tokens=40, ignore_eos=True)) for i in range(6)
        ]
        reqs = run_staggered(engine, specs, gap=0.0)
    assert engine.stats.retracted_requests > 0
    assert sum(r.retractions for r in reqs) == engine.stats.retracted_requests
    for r in reqs:
        assert len(r.output_ids) == 40
        check_logprobs(model, r)


def test_top_p_top_k_restrict_support(hf):
    model, tok = hf
    engine = BatchEngine(model, tok, EngineConfig())
    ids = tok.encode("Answer: ")
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([ids])).logits[0, -1], -1)
    top3 = set(torch.topk(probs, 3).indices.tolist())
    nucleus = set()
    mass = 0.0
    for p, i in zip(*torch.sort(probs, descending=True)):
        nucleus.add(int(i))
        mass += float(p)
        if mass >= 0.5:
            break
    firsts_k, firsts_p = set(), set()
    for s in range(25):
        for params, bag in (
            (SamplingParams(max_new_tokens=1, top_k=3, sampling_seed=s), firsts_k),
            (SamplingParams(max_new_tokens=1, top_p=0.5, sampling_seed=s), firsts_p),
        ):
            r = Request(rid="x", input_ids=ids, params=params, on_finish=lambda r: None)
            engine.submit(r)
            engine._drain_inbox()
            engine._admit()
            bag.add(r.output_ids[0])
    assert firsts_k <= top3 and len(firsts_k) > 1
    assert firsts_p <= nucleus


def test_uniforms_are_uniform_and_counter_based():
    seeds = torch.arange(4000, dtype=torch.long)
    u = uniforms(seeds, torch.zeros_like(seeds))
    assert 0 <= float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.02
    assert torch.equal(u, uniforms(seeds, torch.zeros_like(seeds)))
    assert not torch.equal(u, uniforms(seeds, torch.ones_like(seeds)))


def test_parse_generate_accepts_areal_payload_and_rejects_unknown():
    body = {
        "input_ids": [3, 4],
        "image_data": [],
        "sampling_params": {
            "top_p": 1.0,
            "top_k": 100000000,
            "max_new_tokens": 5,
            "temperature": 0.0,
            "stop_token_ids": [],
            "ignore_eos": False,
            "skip_special_tokens": True,
            "frequency_penalty": 0.0,
            "stop": ["</calc>"],
        },
        "return_logprob": True,
        "stream": False,
    }
    gi = parse_generate(body)
    assert gi.params.stop == ["</calc>"] and gi.params.temperature == 0.0 and gi.params.top_k == 100000000
    with pytest.raises(RequestError, match="return_routed"):
        parse_generate({**body, "return_routed_experts": True})
    with pytest.raises(RequestError, match="min_p"):
        parse_generate({**body, "sampling_params": {"min_p": 0.1}})


def test_finish_text_trims_like_sglang(hf):
    _, tok = hf
    ids = tok.encode("12</c>34")
    sp = SamplingParams(stop=["</c>"])
    assert finish_text(tok, ids, sp, {"type": "stop", "matched": "</c>"}) == "12"
    sp.no_stop_trim = True
    assert finish_text(tok, ids, sp, {"type": "stop", "matched": "</c>"}) == "12</c>34"
    eos = tok.eos_token_id
    assert (
        finish_text(tok, ids[:2] + [eos], SamplingParams(skip_special_tokens=False), {"type": "stop", "matched": eos})
        == "12"
    )


def test_multi_turn_reuses_previous_turn_cache(hf):
    """Turn 2 re-sends prompt + turn-1 output + a tool return: only the new tail is prefilled, and its
    logprobs equal a plain forward of the whole conversation."""
    model, tok = hf
    with running(model, tok, EngineConfig(max_running_requests=8)) as engine:
        firsts = run_staggered(
            engine,
            [
                (tok.encode(f"What is {i}*7? "), SamplingParams(max_new_tokens=12 + i, ignore_eos=True))
                for i in range(4)
            ],
            gap=0.0,
        )
        tool = tok.encode("<r>42</r>")
        before = engine.stats.prefill_tokens
        seconds = run_staggered(
            engine,
            [(r.input_ids + r.output_ids + tool, SamplingParams(max_new_tokens=10, ignore_eos=True)) for r in firsts],
            gap=0.0,
        )
    # the last sampled token of turn 1 was never fed back, so it is prefilled with the tool return
    assert engine.stats.prefill_tokens - before == 4 * (len(tool) + 1)
    for first, second in zip(firsts, seconds):
        assert second.cached_tokens == len(first.input_ids) + len(first.output_ids) - 1
        check_logprobs(model, second)
    engine2 = BatchEngine(model, tok, EngineConfig(prefix_cache_tokens=0))
    assert engine2.prefix_cache is None


def test_frequency_penalty_discourages_repeats(hf):
    model, tok = hf
    engine = BatchEngine(model, tok, EngineConfig())
    assert engine._counts.shape[1] == 1  # no penalty table until a request needs one
    ids = tok.encode("What is 1+1? ")
    outs = {}
    for fp in (0.0, 2.0):
        r = Request(
            rid=str(fp),
            input_ids=ids,
            params=SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True, frequency_penalty=fp),
            on_finish=lambda r: None,
        )
        engine.submit(r)
        engine._drain_inbox()
        engine._admit()
        while engine.num_running():
            engine._decode_step()
        outs[fp] = r.output_ids
    assert engine._counts.shape[1] == engine.vocab_size
    assert len(set(outs[2.0])) > len(set(outs[0.0]))


def test_stop_string_candidates_cache_is_bounded(hf):
    """Per-request stop strings (e.g. ones that quote the problem) must not grow the server's memory: each
    distinct set caches a frozenset of up to vocabulary-size token ids (~10 MB for a 150k vocabulary), so
    the cache keeps only the most recent STOP_CANDIDATE_CACHE sets, and a re-used set still answers."""
    from areal_libra.server.batching import STOP_CANDIDATE_CACHE

    model, tok = hf
    with running(model, tok, EngineConfig(max_running_requests=8)) as engine:
        reqs = run_staggered(
            engine,
            [(tok.encode("Hi"), SamplingParams(max_new_tokens=2, stop=[f"end{i}x"])) for i in range(3 * STOP_CANDIDATE_CACHE)],
            gap=0.0,
        )
    assert all(r.finish_reason is not None for r in reqs)
    assert len(engine._candidate_cache) <= STOP_CANDIDATE_CACHE
    # the most recent set is kept and gives the same answer as a fresh computation
    last = (f"end{3 * STOP_CANDIDATE_CACHE - 1}x",)
    assert last in engine._candidate_cache
    cached = engine._candidate_cache[last]
    engine._candidate_cache.clear()
    assert engine._stop_candidates(last) == cached


def test_waiting_requests_are_admitted_lowest_priority_value_first(hf):
    """Libra's bounded lag sends each request with its trajectory's start version as priority (SGLang's
    --schedule-low-priority-values-first): the oldest trajectory's waiting request goes first, arrival order
    among equals, requests without a priority after all others; /generate's parser carries it through."""
    model, tok = hf
    engine = BatchEngine(model, tok, EngineConfig(max_running_requests=1))
    finished: list[str] = []  # one running request at a time: the finish order is the admission order
    ids = tok.encode("Hi")
    for rid, prio in (("none", None), ("v5", 5), ("v1a", 1), ("v3", 3), ("v1b", 1)):
        engine.submit(Request(rid=rid, input_ids=ids, params=SamplingParams(max_new_tokens=2, ignore_eos=True),
                              on_finish=lambda r: finished.append(r.rid), priority=prio))
    engine._drain_inbox()
    while engine._waiting or engine.num_running():
        engine._admit()
        while engine.num_running():
            engine._decode_step()
    assert finished == ["v1a", "v1b", "v3", "v5", "none"]
    assert parse_generate({"input_ids": [1], "priority": 7}).priority == 7
    assert parse_generate({"input_ids": [1]}).priority is None
    with pytest.raises(RequestError, match="priority must be an integer"):
        parse_generate({"input_ids": [1], "priority": "old"})
