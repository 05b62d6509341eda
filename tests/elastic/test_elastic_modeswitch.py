"""Mode switch against the real embedded SGLang-API server: release starts a server with the replica's
current weights; join drains it and its in-flight request comes back (finish reason abort), not lost."""

from __future__ import annotations

import shutil
import threading
import time

import torch

from areal_libra.elastic_runtime.modeswitch import HttpRollout


def test_http_rollout_start_with_current_weights_and_drain(tmp_path):
    from transformers import AutoModelForCausalLM

    from areal_libra.models.random_tiny import TinyModelSpec, build_tiny_model
    from areal_libra.server.inprocess import InProcessServer, http

    base = build_tiny_model(str(tmp_path / "base"), TinyModelSpec(seed=0))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)  # the hybrid replica's weights
    servers: list = []

    def launch(replica):
        # Current weights -> checkpoint -> server: what a released hybrid replica does with its devices.
        ckpt = tmp_path / f"ckpt{len(servers)}"
        shutil.copytree(base, ckpt)
        replica.save_pretrained(str(ckpt))
        srv = InProcessServer(str(ckpt), max_running_requests=8, seed=0)
        servers.append(srv)
        return f"http://{srv.addr}", srv.close

    registered, unregistered = [], []
    side = HttpRollout(launch, registered.append, unregistered.append, ready_timeout_s=60)
    side.start(model)
    assert registered == [side.url]
    addr = side.url.removeprefix("http://")
    ids = servers[0].tokenizer.encode("What is 12+30? ")
    greedy = {"max_new_tokens": 8, "temperature": 0}
    _, first = http(addr, "/generate", {"input_ids": ids, "sampling_params": greedy, "return_logprob": True})

    box = {}

    def long_request():
        box["out"] = http(addr, "/generate", {"input_ids": ids, "rid": "victim",
                                              "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}})

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.time() + 30
    while not any(r is not None and r.rid == "victim" and len(r.output_ids) > 3
                  for r in servers[0].server.engine.row_req):
        assert time.time() < deadline
        time.sleep(0.01)
    handed = side.drain()  # join: stop routing here, abort in-flight work, take the server down
    t.join(30)
    assert handed == [f"http://{addr}"] and unregistered == [f"http://{addr}"]
    status, out = box["out"]
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"  # came back to the client
    assert 3 < out["meta_info"]["completion_tokens"] < 3000, out

    with torch.no_grad():  # training moved the weights
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    side.start(model)  # release: a new server with the current weights
    assert len(registered) == 2
    _, second = http(side.url.removeprefix("http://"), "/generate",
                     {"input_ids": ids, "sampling_params": greedy, "return_logprob": True})
    lp1 = [x[0] for x in first["meta_info"]["output_token_logprobs"]]
    lp2 = [x[0] for x in second["meta_info"]["output_token_logprobs"]]
    assert lp1 != lp2  # served with the new weights
    side.drain()
