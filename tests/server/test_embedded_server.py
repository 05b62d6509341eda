"""Contract tests: the embedded server against AReaL 1.0.4's own SGLang client, over loopback."""

from __future__ import annotations

import asyncio
import threading
import time

import aiohttp
import pytest
import torch

from areal_libra.server.inprocess import InProcessServer, http


@pytest.fixture(scope="module")
def models(tiny_model_pair):
    return tiny_model_pair


@pytest.fixture(scope="module")
def server(models):
    srv = InProcessServer(models[0], max_running_requests=64, seed=0)
    yield srv
    srv.close()


def ref_logprobs(model_path: str, prompt: list[int], output: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) of each output token, from one plain HF forward over the whole sequence."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    with torch.no_grad():
        logits = m(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
    lp = torch.log_softmax(logits / temperature, -1)
    return lp.gather(1, torch.tensor(output)[:, None]).squeeze(1)


def gen(server, ids, **sp):
    body = {"input_ids": ids, "sampling_params": sp, "return_logprob": True}
    status, out = http(server.addr, "/generate", body)
    assert status == 200, out
    return out


def prompt(server, text="What is 12+30? "):
    return server.tokenizer.encode(text)


# ----------------------------------------------------------------- AReaL's payloads and client
def areal_request(ids, **gconfig):
    from areal.api import ModelRequest
    from areal.api.cli_args import GenerationHyperparameters

    return ModelRequest(input_ids=list(ids), gconfig=GenerationHyperparameters(**gconfig))


def test_areal_payload_roundtrip(server, models):
    """SGLangBackend builds the request (image_data, top_k=1e8, stop_token_ids=[] ...) and parses our reply."""
    from areal.engine.sglang_remote import SGLangBackend

    be = SGLangBackend()
    ids = prompt(server)
    http_req = be.build_generation_request(areal_request(ids, max_new_tokens=24, temperature=1.0), False, 0)
    assert "image_data" in http_req.payload  # the field SGLang accepts and we must too
    status, body = http(server.addr, http_req.endpoint, http_req.payload)
    assert status == 200, body
    res = be.parse_generation_response(body)
    assert len(res.output_tokens) == len(res.output_logprobs) == body["meta_info"]["completion_tokens"]
    assert res.stop_reason in ("length", "stop")
    assert body["output_ids"] == res.output_tokens
    meta = body["meta_info"]
    assert meta["prompt_tokens"] == len(ids) and meta["weight_version"] == "default"
    assert meta["finish_reason"]["type"] == res.stop_reason and isinstance(meta["e2e_latency"], float)
    ref = ref_logprobs(models[0], ids, res.output_tokens)
    assert torch.allclose(ref, torch.tensor(res.output_logprobs), atol=1e-4)


def _areal_engine(addr: str):
    from areal.api.cli_args import InferenceEngineConfig
    from areal.engine.sglang_remote import RemoteSGLangEngine

    cfg = InferenceEngineConfig(
        experiment_name="t",
        trial_name="t",
        backend="sglang:d1",
        setup_timeout=30,
        request_timeout=60,
        pause_grace_period=0.0,
    )
    eng = RemoteSGLangEngine(cfg)
    eng.initialize(addr=[addr], train_data_parallel_size=1)
    return eng


def test_remote_engine_agenerate_concurrent_batches(server, models):
    """RemoteSGLangEngine.agenerate, 24 at once: all complete, logprobs match HF, the server batched them."""
    eng = _areal_engine(server.addr)
    try:
        ids = prompt(server)

        async def run():
            reqs = [areal_request(ids, max_new_tokens=30, temperature=1.0, ignore_eos=True) for _ in range(24)]
            return await asyncio.gather(*[eng.agenerate(r) for r in reqs])

        before = server.engine.stats.max_batch_seen
        server.engine.stats.max_batch_seen = 0
        outs = asyncio.run(run())
        assert all(len(o.output_tokens) == 30 and o.stop_reason == "length" for o in outs)
        assert len({tuple(o.output_tokens) for o in outs}) > 12  # samples differ
        assert server.engine.stats.max_batch_seen >= 12, "concurrent requests were not batched"
        status, info = http(server.addr, "/get_server_info")
        assert info["engine_stats"]["max_batch_seen"] >= 12
        server.engine.stats.max_batch_seen = max(before, server.engine.stats.max_batch_seen)
        ref = ref_logprobs(models[0], ids, outs[3].output_tokens)
        assert torch.allclose(ref, torch.tensor(outs[3].output_logprobs), atol=1e-4)
    finally:
        eng.destroy()


def test_pause_abort_resume_through_areal_client(server, models):
    """pause_generation (abort) mid-request: AReaL re-sends prompt + tokens so far, which wait while paused
    and finish after continue; the stitched output is a valid continuation with correct logprobs."""
    eng = _areal_engine(server.addr)
    try:
        ids = prompt(server)
        aborted0 = server.engine.stats.aborted_requests
        result = {}

        def client():
            req = areal_request(ids, max_new_tokens=400, temperature=1.0, ignore_eos=True)
            result["out"] = asyncio.run(eng.agenerate(req))

        t = threading.Thread(target=client)
        t.start()
        deadline = time.time() + 30
        while server.engine.stats.generated_tokens == 0 or not server.engine.num_running():
            assert time.time() < deadline
            time.sleep(0.01)
        eng.pause_generation()  # AReaL's own call: POST /pause_generation {} to every server
        time.sleep(0.5)
        assert server.engine.stats.aborted_requests > aborted0
        assert t.is_alive(), "request should be held while the server is paused"
        assert server.engine.num_running() == 0
        eng.continue_generation()
        t.join(60)
        out = result["out"]
        assert len(out.output_tokens) == 400 and out.stop_reason == "length"
        ref = ref_logprobs(models[0], ids, out.output_tokens)
        assert torch.allclose(ref, torch.tensor(out.output_logprobs), atol=1e-4)
    finally:
        eng.destroy()


# ----------------------------------------------------------------- weights
def test_update_weights_from_disk_changes_outputs(server, models):
    from areal.api.io_struct import WeightUpdateMeta
    from areal.engine.sglang_remote import SGLangBackend

    ids = prompt(server)
    sp = {"max_new_tokens": 20, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 7}
    before = gen(server, ids, **sp)
    for path, version in ((models[1], "v1"), (models[0], "v2")):
        (req,) = SGLangBackend().build_disk_weight_update_requests(WeightUpdateMeta(type="disk", path=path)).requests
        payload = dict(req.payload, weight_version=version)
        status, body = http(server.addr, req.endpoint, payload)
        assert status == 200 and body["success"] is True and "num_paused_requests" in body
        out = gen(server, ids, **sp)
        assert out["meta_info"]["weight_version"] == version
        lps = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
        ref = ref_logprobs(path, ids, out["output_ids"])
        assert torch.allclose(ref, torch.tensor(lps), atol=1e-4)
        if path == models[1]:
            assert out["meta_info"]["output_token_logprobs"] != before["meta_info"]["output_token_logprobs"]
        else:
            assert out["output_ids"] == before["output_ids"]  # same weights + seed → same sample
    status, info = http(server.addr, "/get_model_info")
    assert info["weight_version"] == "v2" and info["model_path"] == models[0]


def test_areal_versioned_update_sets_the_weight_version(server, models, tmp_path):
    """AReaL 1.0.4 sends no weight_version; its versioned update directory (weight_update_v<N>) gives it."""
    from areal.api.io_struct import WeightUpdateMeta
    from areal.engine.sglang_remote import SGLangBackend

    path = tmp_path / "weight_update_v3"
    path.symlink_to(models[0], target_is_directory=True)
    meta = WeightUpdateMeta(type="disk", path=str(tmp_path / "weight_update")).with_version(3)
    assert meta.path == str(path)
    (req,) = SGLangBackend().build_disk_weight_update_requests(meta).requests
    assert "weight_version" not in req.payload
    try:
        status, body = http(server.addr, req.endpoint, req.payload)
        assert status == 200 and body["success"] is True
        assert http(server.addr, "/get_weight_version")[1]["weight_version"] == "3"
        status, _ = http(server.addr, req.endpoint, {"model_path": models[0]})  # not versioned: unchanged
        assert status == 200 and http(server.addr, "/get_weight_version")[1]["weight_version"] == "3"
    finally:
        http(server.addr, req.endpoint, {"model_path": models[0], "weight_version": "default"})


def test_update_weights_bad_path_keeps_serving(server, tmp_path):
    status, body = http(server.addr, "/update_weights_from_disk", {"model_path": str(tmp_path / "nope")})
    assert status == 400 and body["success"] is False and "nope" in body["message"]
    assert gen(server, prompt(server), max_new_tokens=3)["meta_info"]["completion_tokens"] == 3


# ----------------------------------------------------------------- stops
def test_stop_string_and_stop_token(server):
    ids = prompt(server)
    sp = {"max_new_tokens": 60, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 11}
    free = gen(server, ids, **sp)
    tok = server.tokenizer
    text = free["text"]
    stop = text[20:22]
    k = next(i for i in range(1, 61) if stop in tok.decode(free["output_ids"][:i], skip_special_tokens=True))
    out = gen(server, ids, **sp, stop=[stop, "never-there"])
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["output_ids"] == free["output_ids"][:k]  # the tokens that spell the stop are returned
    assert out["text"] == text[: text.find(stop)]  # the text is cut before the stop string
    out2 = gen(server, ids, **sp, stop=stop, no_stop_trim=True)
    assert out2["text"].endswith(stop) and out2["output_ids"] == out["output_ids"]

    j = 5
    stop_id = free["output_ids"][j]
    first = free["output_ids"].index(stop_id)
    out3 = gen(server, ids, **sp, stop_token_ids=[stop_id])
    assert out3["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert out3["output_ids"] == free["output_ids"][: first + 1]
    assert out3["text"] == tok.decode(free["output_ids"][:first], skip_special_tokens=True)


def test_eos_stops_unless_ignored(server):
    ids = prompt(server)
    eos = server.tokenizer.eos_token_id
    # Make EOS likely: very high temperature flattens the distribution, ~1/48 per token.
    sp = {"max_new_tokens": 300, "temperature": 100.0, "sampling_seed": 3}
    out = gen(server, ids, **sp)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    assert out["output_ids"][-1] == eos and eos not in out["output_ids"][:-1]
    out = gen(server, ids, **sp, ignore_eos=True)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 300}


# ----------------------------------------------------------------- sampling
def test_greedy_and_temperature_logprobs(server, models):
    ids = prompt(server, "Sum 7 and 8: ")
    g1 = gen(server, ids, max_new_tokens=15, temperature=0)
    g2 = gen(server, ids, max_new_tokens=15, temperature=0, top_k=5)
    assert g1["output_ids"] == g2["output_ids"]
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.float32)
    hf = m.generate(torch.tensor([ids]), max_new_tokens=15, do_sample=False, eos_token_id=None, pad_token_id=1)
    assert g1["output_ids"] == hf[0, len(ids) :].tolist()
    out = gen(server, ids, max_new_tokens=15, temperature=0.5, ignore_eos=True)
    lps = torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]])
    assert torch.allclose(ref_logprobs(models[0], ids, out["output_ids"], 0.5), lps, atol=1e-4)


def test_top_k_one_is_greedy_and_seed_is_batch_independent(server):
    ids = prompt(server)
    greedy = gen(server, ids, max_new_tokens=12, temperature=0)["output_ids"]
    assert gen(server, ids, max_new_tokens=12, temperature=1.0, top_k=1)["output_ids"] == greedy
    sp = {"max_new_tokens": 25, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 99}
    alone = gen(server, ids, **sp)["output_ids"]
    results = {}

    def one(i):
        s = dict(sp) if i == 0 else {**sp, "sampling_seed": 1000 + i}
        results[i] = gen(server, ids if i == 0 else prompt(server, f"What is {i}*{i}? "), **s)["output_ids"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results[0] == alone


# ----------------------------------------------------------------- control endpoints
def test_abort_request_returns_tokens_so_far(server):
    box = {}

    def run():
        body = {
            "input_ids": prompt(server),
            "rid": "victim",
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
        }
        box["out"] = http(server.addr, "/generate", body)

    t = threading.Thread(target=run)
    t.start()
    deadline = time.time() + 30
    while not any(r is not None and r.rid == "victim" and len(r.output_ids) > 5 for r in server.engine.row_req):
        assert time.time() < deadline
        time.sleep(0.01)
    status, text = http(server.addr, "/flush_cache")
    assert status == 400 and text.startswith("Cache flushed")  # refused while a request runs
    status, _ = http(server.addr, "/abort_request", {"rid": "victim"})
    assert status == 200
    t.join(30)
    status, out = box["out"]
    assert status == 200
    fr = out["meta_info"]["finish_reason"]
    assert fr["type"] == "abort" and isinstance(fr["message"], str)
    n = out["meta_info"]["completion_tokens"]
    assert 5 < n < 3000 and len(out["meta_info"]["output_token_logprobs"]) == n == len(out["output_ids"])
    status, text = http(server.addr, "/flush_cache", method="POST")
    assert status == 200


def test_continuous_batching_short_requests_overtake_long(server):
    """A request that arrives while a long one is decoding joins the batch and finishes first."""
    long_t, long_box = _start_long_rid(server)
    t0 = time.time()
    short = gen(server, prompt(server), max_new_tokens=5, ignore_eos=True)
    assert short["meta_info"]["completion_tokens"] == 5
    assert long_t.is_alive(), "short request had to wait for the long one"
    assert time.time() - t0 < 30
    http(server.addr, "/abort_request", {"abort_all": True})
    long_t.join(30)
    assert long_box["out"]["meta_info"]["finish_reason"]["type"] == "abort"


def _start_long_rid(server):
    box = {}

    def run():
        body = {
            "input_ids": prompt(server),
            "rid": "long",
            "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
        }
        box["out"] = http(server.addr, "/generate", body)[1]

    t = threading.Thread(target=run)
    t.start()
    deadline = time.time() + 30
    while not any(r is not None and r.rid == "long" for r in server.engine.row_req):
        assert time.time() < deadline
        time.sleep(0.01)
    return t, box


def test_pause_in_place_and_retract_keep_requests(server, models):
    for mode in ("in_place", "retract"):
        t, box = _start_long_rid(server)
        status, body = http(server.addr, "/pause_generation", {"mode": mode})
        assert status == 200 and body == {"message": "Generation paused successfully.", "status": "ok"}
        n_paused = len(
            next(
                r for r in server.engine.row_req + list(server.engine._waiting) if r is not None and r.rid == "long"
            ).output_ids
        )
        time.sleep(0.3)
        held = next(
            r for r in server.engine.row_req + list(server.engine._waiting) if r is not None and r.rid == "long"
        )
        assert len(held.output_ids) == n_paused, f"{mode}: generation went on while paused"
        status, body = http(server.addr, "/continue_generation", {})
        assert status == 200 and body["status"] == "ok"
        deadline = time.time() + 30
        while len(held.output_ids) < n_paused + 10:
            assert time.time() < deadline
            time.sleep(0.01)
        http(server.addr, "/abort_request", {"rid": "long"})
        t.join(30)
        out = box["out"]
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert out["meta_info"]["total_retractions"] == (1 if mode == "retract" else 0)


def test_info_and_health_endpoints(server, models):
    assert http(server.addr, "/health") == (200, "")
    assert http(server.addr, "/health_generate")[0] == 200
    status, info = http(server.addr, "/get_model_info")
    assert status == 200 and info["is_generation"] is True and info["model_path"] == models[0]
    status, info = http(server.addr, "/get_server_info")
    assert info["tp_size"] == 1 and info["max_running_requests"] == 64 and info["port"] == server.args.port
    assert {"max_total_num_tokens", "version", "model_path"} <= set(info)
    for ep in ("/release_memory_occupation", "/resume_memory_occupation"):
        status, body = http(server.addr, ep, {})
        assert status == 200 and body["success"] is True
    status, body = http(server.addr, "/init_weights_update_group", {"master_address": "x"})
    assert status == 400 and body["success"] is False


# ----------------------------------------------------------------- bad requests
@pytest.mark.parametrize(
    "body, needle",
    [
        ({"input_ids": [3, 4], "foo": 1}, "foo"),
        ({"input_ids": [3, 4], "sampling_params": {"bogus": 1}}, "bogus"),
        ({"input_ids": [3, 4], "sampling_params": {"n": 2}}, "n must be 1"),
        ({"input_ids": [3, 4], "sampling_params": {"temperature": "hot"}}, "temperature"),
        ({"input_ids": [3, 4], "sampling_params": {"top_k": 0}}, "top_k"),
        ({"input_ids": [3, 100000]}, "100000"),
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [[1, 2], [3]]}, "batched"),
        ({"text": "hi", "input_ids": [1]}, "exactly one"),
        ({"input_ids": [3], "stream": True}, "stream"),
        ({"input_ids": [3], "image_data": ["img.png"]}, "image_data"),
        ({"input_ids": [3], "lora_path": "x"}, "lora_path"),
        ({"input_ids": [3], "sampling_params": {"stop_token_ids": [1e9]}}, "stop_token_ids"),
        (b"{not json", "JSON"),
        ([1, 2], "JSON object"),
    ],
)
def test_bad_generate_requests(server, body, needle):
    status, out = http(server.addr, "/generate", body)
    assert status == 400
    assert needle in out["error"]["message"]


def test_bad_control_requests(server):
    status, out = http(server.addr, "/pause_generation", {"mode": "sideways"})
    assert status == 400 and "mode" in out["error"]["message"]
    status, out = http(server.addr, "/abort_request", {"rid": "x", "extra": 1})
    assert status == 400 and "extra" in out["error"]["message"]
    status, out = http(server.addr, "/update_weights_from_disk", {"model_path": "x", "what": 1})
    assert status == 400 and out["success"] is False and "what" in out["message"]


def test_text_input_and_context_limit(server):
    out = http(server.addr, "/generate", {"text": "What is 1+1? ", "sampling_params": {"max_new_tokens": 4}})[1]
    assert out["meta_info"]["prompt_tokens"] == len(server.tokenizer.encode("What is 1+1? "))
    assert "output_token_logprobs" not in out["meta_info"]  # only with return_logprob
    too_long = [3] * server.engine.context_len
    status, out = http(server.addr, "/generate", {"input_ids": too_long})
    assert status == 400 and "context length" in out["error"]["message"]


def test_client_disconnect_frees_the_slot(server):
    async def run():
        timeout = aiohttp.ClientTimeout(total=0.5)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            body = {
                "input_ids": prompt(server),
                "rid": "gone",
                "sampling_params": {"max_new_tokens": 5000, "ignore_eos": True},
            }
            with pytest.raises(asyncio.TimeoutError):
                await s.post(f"http://{server.addr}/generate", json=body)

    asyncio.run(run())
    deadline = time.time() + 10
    while any(r is not None and r.rid == "gone" for r in server.engine.row_req):
        assert time.time() < deadline, "abandoned request still decoding"
        time.sleep(0.05)


def test_areal_score_request_input_logprobs(server, models):
    """SGLangBackend.build_score_request (logprob_start_len, top_logprobs_num) → prompt-token logprobs."""
    from areal.engine.sglang_remote import SGLangBackend

    be = SGLangBackend()
    ids = prompt(server, "What is 5*6? Answer: 30")
    target = 6
    req = be.build_score_request(ids, target, False, 0)
    status, body = http(server.addr, req.endpoint, req.payload)
    assert status == 200, body
    got = torch.tensor(be.parse_score_response(body, target))
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.float32)
    with torch.no_grad():
        lp = torch.log_softmax(m(torch.tensor([ids])).logits[0], -1)
    ref = lp[len(ids) - target - 1 : -1].gather(1, torch.tensor(ids[-target:])[:, None]).squeeze(1)
    assert torch.allclose(got, ref, atol=1e-4)
    first = gen(server, ids, max_new_tokens=1) | {}
    assert "input_token_logprobs" not in first["meta_info"]
    status, body = http(server.addr, "/generate", {**req.payload, "logprob_start_len": 0})
    entries = body["meta_info"]["input_token_logprobs"]
    assert len(entries) == len(ids) and entries[0][0] is None and entries[0][1] == ids[0]


def test_zero_new_tokens_and_unknown_abort(server):
    status, out = http(server.addr, "/generate", {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 0}})
    assert (
        status == 200
        and out["output_ids"] == []
        and out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    )
    assert http(server.addr, "/abort_request", {"rid": "no-such-request"})[0] == 200
    assert gen(server, [3, 4, 5], max_new_tokens=2)["meta_info"]["completion_tokens"] == 2
