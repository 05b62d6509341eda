"""Heterogeneous rollout groups with C-MLFQ dispatch inside AReaL, over loopback: real embedded servers in
two groups, AReaL's RemoteSGLangEngine + WorkflowExecutor, the project's MathToolWorkflow and its
calculator. Covers: migration at tool returns, intact tokens/logprobs across migrations, no request
bypassing the dispatcher, and a server killed mid-rollout losing no trajectory."""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from areal_libra.rollout.groups import RolloutGroup
from areal_libra.rollout.router import DispatchConfig, RequestRouter
from areal_libra.trace import Segment, ToolReturn, Trajectory

pytestmark = pytest.mark.slow  # starts three servers and AReaL engines: ~3 minutes on 2 shared cores

MAX_TOKENS = 256
SHORT = RolloutGroup("short", tp=1, count=2, threads=1, max_running=64, max_len=200)
LONG = RolloutGroup("long", tp=2, count=1, threads=1, max_running=64, max_len=MAX_TOKENS)


def build_tool_model(out_dir: Path, seed: int = 0) -> str:
    """A random Qwen2 LM on the project's tokenizer whose next-token distribution leans towards calculator
    markup (`<calc>`, digits, `+`, `</calc>`), so the real workflow makes real tool calls that succeed or
    fail; hidden states keep a random, context-dependent part, so logprobs differ position by position."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from areal_libra.models.tiny import _tokenizer_corpus
    from areal_libra.models.tokenizer import build_tokenizer

    tok = build_tokenizer(_tokenizer_corpus(200), 384)
    vocab = -(-len(tok) // 64) * 64
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    probs = torch.zeros(vocab)
    digits = [tok.convert_tokens_to_ids(c) for c in "0123456789+"]
    probs[digits] = 0.74 / len(digits)
    probs[tok.convert_tokens_to_ids("<calc>")] = 0.12
    probs[tok.convert_tokens_to_ids("</calc>")] = 0.12
    probs[tok.eos_token_id] = 0.02
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 0.3)
        model.model.embed_tokens.weight[:, 0] = 8.0  # a constant direction carries the preference
        model.lm_head.weight.normal_(0.0, 0.02)
        model.lm_head.weight[:, 0] = torch.log(probs.clamp_min(1e-9)) / math.sqrt(cfg.hidden_size)
    model.save_pretrained(str(out_dir))
    tok.save_pretrained(str(out_dir))
    return str(out_dir)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, embedded_servers):
    """Tool model + three embedded servers: group short (2 x TP1) and group long (1 x TP2)."""
    from areal_libra.rollout.groups import expand_servers
    from areal_libra.rollout.launcher import ServerSpec

    root = tmp_path_factory.mktemp("hetero")
    model = build_tool_model(root / "model")
    specs = [ServerSpec(tp=g.tp, threads=g.threads, max_running=g.max_running, group=g.name)
             for g in expand_servers([SHORT, LONG])]
    return model, embedded_servers(model, specs, timeout=180), root


def make_engine(addrs: list[str]):
    from areal.api.cli_args import InferenceEngineConfig
    from areal.engine.sglang_remote import RemoteSGLangEngine

    cfg = InferenceEngineConfig(backend=f"sglang:d{len(addrs)}t1", experiment_name="hetero", trial_name="t",
                                max_concurrent_rollouts=64, consumer_batch_size=64, max_head_offpolicyness=100,
                                setup_timeout=60, request_timeout=60, request_retries=2)
    eng = RemoteSGLangEngine(cfg)
    eng.initialize(addr=addrs)
    return eng


def make_router(handles, run_dir: Path) -> RequestRouter:
    short = [h.addr for h in handles if h.spec.group == "short"]
    long = [h.addr for h in handles if h.spec.group == "long"]
    cfg = DispatchConfig(cmlfq={"start_lookup": False}, spill_ratio=None, health_interval_s=0.5, health_timeout_s=2.0,
                         fail_after=1, watch_interval_s=0.2)
    return RequestRouter([SHORT, LONG], [short, long], cfg, run_dir=run_dir)


def teach(router: RequestRouter, n: int = 8) -> None:
    """Earlier steps' history: after a successful calculator call the answer ran long (100 more tokens),
    after a failed one it ended at once. C-MLFQ learns it from these finished trajectories."""
    for i in range(n):
        router.on_trajectory(Trajectory(f"old-s{i}", f"old{i}", 0, 125,
                                        (Segment(6, ToolReturn("calculator", 3, "success")), Segment(100)), "stop"))
        router.on_trajectory(Trajectory(f"old-f{i}", f"old{i}", 0, 125,
                                        (Segment(6, ToolReturn("calculator", 45, "failure")), Segment(3)), "stop"))
    router.step_metrics()
    router.live.wait(10)


def rollout(eng, router, model: str, n_prompts: int, group: int, seed: int = 0) -> tuple[list, list[Trajectory]]:
    from areal.api.cli_args import GenerationHyperparameters

    from areal_libra.workflows import math_tool
    from areal_libra.workflows.math_data import load_math_dataset

    trajs: list[Trajectory] = []
    sinks = [trajs.append] + ([router.on_trajectory] if router is not None else [])
    math_tool.set_trajectory_sink(lambda t: [s(t) for s in sinks])
    ds = load_math_dataset(None, size=n_prompts, seed=seed)
    g = GenerationHyperparameters(n_samples=group, max_new_tokens=32, max_tokens=MAX_TOKENS, temperature=1.0)
    try:
        out = eng.rollout_batch([ds[i] for i in range(n_prompts)], workflow=math_tool.MathToolWorkflow,
                                workflow_kwargs=dict(gconfig=g, tokenizer_path=model, max_turns=3), group_size=group)
    finally:
        math_tool.set_trajectory_sink(None)
    return out, trajs


def split_samples(out) -> list[dict]:
    """rollout_batch's result as one dict of 1-D tensors per trajectory (padding removed)."""
    batches = out if isinstance(out, list) else [out]
    samples = []
    for b in batches:
        for i in range(b["input_ids"].shape[0]):
            n = int(b["attention_mask"][i].sum())
            samples.append({k: b[k][i][:n] for k in ("input_ids", "loss_mask", "logprobs", "versions")})
    return samples


def check_intact(model_path: str, samples: list[dict], trajs: list[Trajectory]) -> None:
    """Every generated token's logprob is the model's own at that position (recomputed in one forward over
    the whole trajectory), tool-result tokens are masked, and lengths match the trajectory records."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
    for s in samples:
        ids = s["input_ids"].long()
        mask = s["loss_mask"].bool()
        with torch.no_grad():
            logits = model(ids.unsqueeze(0)).logits[0].float()
        lp = torch.log_softmax(logits, -1)
        pos = torch.nonzero(mask).squeeze(-1)
        assert len(pos) > 0 and int(pos.min()) > 0
        want = lp[pos - 1, ids[pos]]
        got = s["logprobs"][pos].float()
        assert torch.allclose(got, want, atol=2e-3), (got - want).abs().max()
        assert bool((s["logprobs"][~mask] == 0).all()) and bool((s["versions"][~mask] == -1).all())
    lengths = sorted((len(s["input_ids"]), int(s["loss_mask"].sum())) for s in samples)
    assert lengths == sorted((t.final_length, t.model_tokens) for t in trajs)


def server_requests(addr: str) -> int:
    with urllib.request.urlopen(f"http://{addr}/get_server_info", timeout=10) as r:
        st = json.loads(r.read())["engine_stats"]
    return int(st["finished_requests"]) + int(st["aborted_requests"])


OFF_SCRIPT = r"""
import asyncio, json, random, sys
random.seed(0)  # AReaL starts round-robin at a random server
from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig
from areal.api.io_struct import ModelRequest
from areal.engine.sglang_remote import RemoteSGLangEngine

addrs = sys.argv[1].split(",")
eng = RemoteSGLangEngine(InferenceEngineConfig(backend="sglang:d3t1", experiment_name="off", trial_name="t",
                                               setup_timeout=60, request_timeout=60))
eng.initialize(addr=addrs)

async def go():
    out = []
    for i in range(7):  # rids r0..r3, then r0..r2 again: a known rid sticks to its server
        req = ModelRequest(rid=f"r{i % 4}", input_ids=[5 + i, 7, 9, 11],
                           gconfig=GenerationHyperparameters(max_new_tokens=6, max_tokens=64, greedy=True))
        resp = await eng.agenerate(req)
        out.append([eng._engine.rid_to_address[req.rid], resp.output_tokens,
                    [round(x, 4) for x in resp.output_logprobs], resp.stop_reason])
    return out

res = asyncio.run(go())
eng.pause_generation()
eng.continue_generation()
print("RESULT " + json.dumps({"requests": res, "router": eng._engine.request_router is not None
                              if hasattr(eng._engine, "request_router") else None}))
eng.destroy()
"""


def _run_off(addrs: list[str], pythonpath: str | None) -> dict:
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", OFF_SCRIPT, ",".join(addrs)], capture_output=True, text=True,
                       timeout=300, env=env)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert r.returncode == 0 and line, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads(line[len("RESULT "):])


def test_with_the_feature_off_areal_behaves_as_without_the_patches(fleet, tmp_path) -> None:
    """scheduler.policy=round_robin installs no router: the patched AReaL must pick the same servers and
    return the same tokens as AReaL without this project's dispatch patches (only patch 01, which lets
    AReaL import without SGLang, applied)."""
    import shutil

    from areal_libra import patches

    _, handles, _ = fleet
    addrs = [h.addr for h in handles]
    base = tmp_path / "base"
    shutil.copytree(Path(patches.find_areal_root(None)) / "areal", base / "areal",
                    ignore=shutil.ignore_patterns("__pycache__"))
    all_patches = patches.load_patches()
    patches.revert(base, all_patches)
    patches.apply(base, [p for p in all_patches if p.name.startswith("01-")])
    assert "set_request_router" not in (base / "areal" / "infra" / "remote_inf_engine.py").read_text()
    before = _run_off(addrs, str(base))
    after = _run_off(addrs, None)
    assert before["router"] is None and after["router"] is False  # patched engine, no router installed
    assert after["requests"] == before["requests"]
    servers = [r[0] for r in after["requests"]]
    assert len(set(servers[:3])) == 3 and servers[4:] == servers[:3]  # round-robin, then rid stickiness


def test_tool_returns_that_predict_long_answers_migrate_and_outputs_stay_intact(fleet, tmp_path) -> None:
    model, handles, _ = fleet
    addrs = [h.addr for h in handles]
    before = {a: server_requests(a) for a in addrs}
    router = make_router(handles, tmp_path)
    eng = make_engine(addrs)
    try:
        eng.set_request_router(router)
        teach(router)
        out, trajs = rollout(eng, router, model, n_prompts=4, group=4)
    finally:
        eng.destroy()
        router.close()
    samples = split_samples(out)
    assert len(samples) == len(trajs) == 16
    long_addr = router.group_addrs[1][0]
    migrated = 0
    for t in trajs:
        placed = router.placement_log[t.trajectory_id]
        assert placed[0] == (0, placed[0][1]) and router.group_of[placed[0][1]] == 0  # starts short
        statuses = [x.status for x in t.tool_returns()]
        for _, addr in placed[1:]:
            # the history knows one call deep: a successful first call predicts a long answer, so the larger
            # group serves the rest of the trajectory; a failed one predicts a short end and later states
            # have no trusted node, so the trajectory stays where it was
            if statuses[0] == "success":
                assert addr == long_addr, (t.trajectory_id, placed, statuses)
            else:
                assert router.group_of[addr] == 0, (t.trajectory_id, placed, statuses)
        migrated += any(addr == long_addr for _, addr in placed)
    print(f"migrated {migrated} of {len(trajs)}; requests per server {router.addr_requests}")
    assert migrated >= 1, "no trajectory made a successful tool call (model or workflow changed?)"
    m = router.step_metrics()
    assert m["cmlfq/migrations"] == migrated and m["cmlfq/migrated_tokens"] > 0
    assert m["cmlfq/finished"] == 16 and m["cmlfq/decision_accuracy"] is not None
    # the dispatcher is what AReaL calls: every /generate every server served was routed by it
    served = {a: server_requests(a) - before[a] for a in addrs}
    assert served == router.addr_requests and sum(served.values()) == m["cmlfq/routed"] > 16
    check_intact(model, samples, trajs)
    # the finished trajectories reached the live tree at the step boundary
    assert router.live.tree.node_count() > 3


def test_killing_a_server_mid_rollout_loses_no_trajectory(fleet, tmp_path) -> None:
    model, handles, _ = fleet
    victim = next(h for h in handles if h.spec.group == "short")
    router = make_router(handles, tmp_path)
    eng = make_engine([h.addr for h in handles])
    killed = threading.Event()

    def killer() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and router.addr_requests.get(victim.addr, 0) < 3:
            time.sleep(0.02)
        victim.kill()
        killed.set()

    try:
        eng.set_request_router(router)
        threading.Thread(target=killer, daemon=True).start()
        out, trajs = rollout(eng, router, model, n_prompts=8, group=4, seed=1)
        # a weight-update round after the loss: pause/continue skip the dead server instead of failing
        eng.pause_generation()
        eng.continue_generation()
    finally:
        eng.destroy()
        router.close()
    assert killed.is_set() and not victim.alive()
    samples = split_samples(out)
    assert len(samples) == len(trajs) == 32  # nothing lost
    assert victim.addr in router.down_addresses()
    tot = router.totals()
    print(f"after the kill: {tot}")
    assert tot["health_down"] >= 1
    check_intact(model, samples, trajs)
    # after it was marked down, nothing more was sent to it
    events = [json.loads(x) for x in (tmp_path / "dispatch_health.jsonl").read_text().splitlines()]
    assert any(e["addr"] == victim.addr and not e["up"] for e in events)


@pytest.fixture(scope="module")
def spare(fleet, embedded_servers):
    """One more short-group server, to be killed in the middle of a weight update."""
    from areal_libra.rollout.launcher import ServerSpec

    model, _, _ = fleet
    return embedded_servers(model, [ServerSpec(tp=SHORT.tp, threads=1, max_running=64, group="short")])[0]


def _has_connection(addr: str) -> bool:
    """An established TCP connection to addr's port (the weight-update request reached its socket)."""
    port = int(addr.rsplit(":", 1)[1])
    for row in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = row.split()[1], row.split()[3]
        if state == "01" and int(local.split(":")[1], 16) == port:
            return True
    return False


def test_killing_a_server_mid_weight_update_loses_no_trajectory(fleet, spare, tmp_path) -> None:
    """AReaL's disk weight update (pause_generation, /update_weights_from_disk on every server, continue) runs
    while a rollout is in flight, and one server is SIGKILLed while its /update_weights_from_disk request is
    open. The update completes on the survivors, the dead server stays out, every trajectory completes."""
    import os
    import shutil
    import signal

    from areal.api.cli_args import NameResolveConfig
    from areal.api.io_struct import WeightUpdateMeta
    from areal.utils import name_resolve, names

    name_resolve.reconfigure(NameResolveConfig(type="nfs", nfs_record_root=str(tmp_path / "name_resolve")))

    model, handles, root = fleet
    alive = [h for h in handles if h.alive()] + [spare]  # an earlier test may have killed one
    new_weights = root / "model_v1"  # same weights under a new path: logprobs stay checkable
    if not new_weights.exists():
        shutil.copytree(model, new_weights)
    short = [h.addr for h in alive if h.spec.group == "short"]
    long = [h.addr for h in alive if h.spec.group == "long"]
    cfg = DispatchConfig(cmlfq={"start_lookup": False}, spill_ratio=None, health_interval_s=0.5, health_timeout_s=2.0,
                         fail_after=1, watch_interval_s=0.2)
    router = RequestRouter([SHORT, LONG], [short, long], cfg, run_dir=tmp_path)
    eng = make_engine([h.addr for h in alive])
    result: dict = {}

    def run_rollout() -> None:
        try:
            result["out"], result["trajs"] = rollout(eng, router, model, n_prompts=6, group=4, seed=2)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            result["error"] = e

    try:
        eng.set_request_router(router)
        router.attach_engine(eng)
        worker = threading.Thread(target=run_rollout, daemon=True)
        worker.start()
        deadline = time.monotonic() + 60
        while router.addr_requests.get(spare.addr, 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert worker.is_alive(), "the rollout ended before the weight update began"
        version = eng.get_version()
        # AReaL's FSDP engine: pause_generation, update future, save + announce, wait, continue.
        eng.pause_generation()
        os.kill(spare.proc.pid, signal.SIGSTOP)  # holds the victim inside the update request
        fut = eng.update_weights_from_disk(WeightUpdateMeta(type="disk", path=str(new_weights)))
        name_resolve.add(names.update_weights_from_disk(eng.config.experiment_name, eng.config.trial_name, version),
                         str(time.time()))
        deadline = time.monotonic() + 20
        while not _has_connection(spare.addr) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _has_connection(spare.addr), "the update request never reached the victim"
        spare.kill()  # SIGKILL while its /update_weights_from_disk is open
        fut.result(timeout=120)
        eng.set_version(version + 1)
        eng.continue_generation()
        assert worker.is_alive(), "the rollout ended during the update: nothing was in flight"
        worker.join(120)
    finally:
        eng.destroy()
        router.close()
    assert "error" not in result, result.get("error")
    samples, trajs = split_samples(result["out"]), result["trajs"]
    assert len(samples) == len(trajs) == 24  # nothing lost
    assert not spare.alive() and spare.addr in router.down_addresses()
    assert spare.addr in router._missed_update  # reported by the update itself: it stays out for good
    assert not router._may_readmit(spare.addr)
    for h in alive:
        if h is not spare:  # the survivors took the new weights and still serve
            info = json.loads(urllib.request.urlopen(f"http://{h.addr}/get_model_info", timeout=10).read())
            assert info["model_path"] == str(new_weights), (h.addr, info["model_path"])
    check_intact(model, samples, trajs)
    tot = router.totals()
    print(f"mid-update kill: {len(trajs)} trajectories, totals {tot}")
