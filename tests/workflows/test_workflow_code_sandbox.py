"""CodeSandboxWorkflow against the real inference path (the embedded SGLang-API server driven by AReaL's own
RemoteSGLangEngine): sandbox outputs are loss-masked tool returns named `python`, the reward is the hidden
tests' pass fraction in [0, 1], requests carry the C-MLFQ state, and the episodes, written as a trace,
replay through evaluation.routing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from areal_libra.models.tiny import ensure_model
from areal_libra.trace import read_traces, write_traces
from areal_libra.workflows import code_sandbox
from areal_libra.workflows.code_data import load_code_dataset, row_tests
from areal_libra.workflows.code_markup import OUT_CLOSE, OUT_OPEN, last_code
from areal_libra.workflows.sandbox import grade
from tests.workflows._episode import collected_trajectories, run_episodes, served_engine, tiny_policy

ROOT = Path(__file__).resolve().parents[2]
# Trained briefly on code demonstrations, so that episodes do write and run code.
CODE_USER = tiny_policy("test-code-user", task="code", tool_only=False)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(ensure_model(cache_dir=tmp_path_factory.mktemp("cache"), config=CODE_USER, quiet=True))


@pytest.fixture(scope="module")
def engine(model_path):
    with served_engine(model_path) as eng:
        yield eng


@pytest.fixture
def sink():
    with collected_trajectories() as got:
        yield got


def episodes(engine, model_path, rows, **kw):
    from areal.api.cli_args import GenerationHyperparameters

    gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=48, max_tokens=160, temperature=1.0)
    wf = code_sandbox.CodeSandboxWorkflow(gconfig=gconfig, tokenizer_path=model_path, **kw)
    return (wf, *run_episodes(wf, engine, rows))


def test_episodes_mask_tool_outputs_reward_and_replay(engine, model_path, sink, tmp_path):
    rows = [dict(r) for r in load_code_dataset(None, 16, seed=5)]
    wf, rec, results = episodes(engine, model_path, rows)
    tok = wf.tokenizer
    assert len(sink) == len(rows)
    tools = [t for traj in sink for t in traj.tool_returns()]
    assert tools and {t.name for t in tools} == {"python"}, "no episode ran its code"
    assert {t.status for t in tools} <= {"success", "failure", "timeout"}
    by_traj: dict[str, list] = {}
    for req in rec.requests:
        by_traj.setdefault(req.metadata["trajectory_id"], []).append(req)
    for row, res in zip(rows, results):
        traj = next(t for t in sink if t.prompt_id == row["prompt_id"])
        ids, mask = res["input_ids"][0].tolist(), res["loss_mask"][0].tolist()
        lp, ver = res["logprobs"][0].tolist(), res["versions"][0].tolist()
        reqs = by_traj[traj.trajectory_id]
        assert len(reqs) == len(traj.segments) and len(ids) == traj.final_length
        for k, req in enumerate(reqs):  # the C-MLFQ state each request carries
            md = req.metadata
            assert md["turn"] == k and md["context_tokens"] == len(req.input_ids)
            assert md["tool_returns"] == [{"name": t.name, "payload_tokens": t.payload_tokens, "status": t.status}
                                          for t in traj.tool_returns()[:k]]
        pos = traj.prompt_tokens
        assert not any(mask[:pos])
        for seg in traj.segments:
            assert all(mask[pos: pos + seg.gen_tokens])
            pos += seg.gen_tokens
            if seg.tool is not None:
                span = slice(pos, pos + seg.tool.payload_tokens)
                text = tok.decode(ids[span])
                assert text.startswith(OUT_OPEN) and text.endswith(OUT_CLOSE), text
                assert not any(mask[span]) and set(lp[span]) == {0.0} and set(ver[span]) == {-1}
                pos += seg.tool.payload_tokens
        assert pos == len(ids)
        # The reward is the hidden tests' pass fraction of the last code block, recomputed independently.
        completion = tok.decode(ids[traj.prompt_tokens:], skip_special_tokens=True)
        reward = float(res["rewards"][0])  # AReaL's rewards tensor is float32: 1/6 is not 1/6 there
        assert 0.0 <= reward <= 1.0 and reward == pytest.approx(traj.reward, rel=1e-6)
        assert reward == pytest.approx(grade(last_code(completion), row_tests(row)[1]))
    # The episodes as a trace file in the repo's format: it reads back and replays through the routing CLI.
    trace = tmp_path / "code.jsonl"
    write_traces(trace, sink)
    back = {t.trajectory_id: t for t in read_traces(trace)}
    assert back == {t.trajectory_id: t for t in sink}
    r = subprocess.run([sys.executable, "-m", "evaluation.routing", "--train", str(trace), "--eval", str(trace),
                        "--buckets", "60,120,160", "--policies", "cmlfq,mlfq,oracle", "--json"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["n_trajectories"] == len(sink)
    assert out["policies"]["oracle"]["decision_accuracy"] == 1.0
    # and the simulator replays it as a workload (Libra and its baseline on a simulated cluster)
    r = subprocess.run([sys.executable, "-m", "evaluation.throughput", "--workload", str(trace), "--steps", "2",
                        "--group-size", "4", "--batch-prompts", "4", "--systems", "areal_static_optimal", "libra",
                        "--json"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    systems = json.loads(r.stdout)["systems"]
    assert set(systems) == {"areal_static_optimal", "libra"}
    assert all(s["steps"] == 2 and s["tokens_per_s"] > 0 for s in systems.values())


def test_sandbox_timeouts_are_outcomes(engine, model_path, sink):
    rows = [dict(r) for r in load_code_dataset(None, 6, seed=6)]
    wf, _, results = episodes(engine, model_path, rows, tool_timeout_s=1e-4, tool_workers=1)
    assert len(results) == len(rows) == len(sink)
    statuses = [t.status for traj in sink for t in traj.tool_returns()]
    # A run can still beat a 0.1 ms limit (the pre-forked child reads the code before the clock starts), so
    # not every call times out (seen on a loaded clean clone: 3 timeouts, 2 fast failures); the episodes must
    # all finish with the timeouts recorded as outcomes.
    assert "timeout" in statuses and set(statuses) <= {"timeout", "failure", "success"}
    assert all(0.0 <= float(r["rewards"][0]) <= 1.0 for r in results)
    texts = [wf.tokenizer.decode(r["input_ids"][0].tolist()) for r in results]
    assert any(f"{OUT_OPEN}Timeout{OUT_CLOSE}" in t for t in texts)  # what the model sees
