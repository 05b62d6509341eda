"""SearchR1Workflow against real processes: a real embedded rollout server driven by AReaL 1.0.4's own
RemoteSGLangEngine, and the project's BM25 retrieval server. The finished episodes, written as a trace,
replay through evaluation.routing."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from areal_libra.models.tiny import ensure_model
from areal_libra.rollout.launcher import ServerSpec
from areal_libra.trace import read_traces, write_traces
from areal_libra.workflows import search_r1
from areal_libra.workflows.retriever import RetrieverProcess
from areal_libra.workflows.search_data import load_search_dataset
from areal_libra.workflows.search_markup import INFO_CLOSE, INFO_OPEN, exact_match_reward
from tests.workflows._episode import areal_engine, collected_trajectories, run_episodes, tiny_policy

SEARCHER = tiny_policy("test-searcher", task="search_r1")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(ensure_model(cache_dir=tmp_path_factory.mktemp("cache"), config=SEARCHER, quiet=True))


@pytest.fixture(scope="module")
def retriever(tmp_path_factory):
    proc = RetrieverProcess(tmp_path_factory.mktemp("retriever") / "retriever.log")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def engine(model_path, embedded_servers):
    srv = embedded_servers(model_path, [ServerSpec(max_running=32)])[0]
    with areal_engine(srv.addr) as eng:
        yield eng


@pytest.fixture
def sink():
    with collected_trajectories() as got:
        yield got


def episodes(engine, model_path, url, rows, **kw):
    from areal.api.cli_args import GenerationHyperparameters

    gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=32, max_tokens=200, temperature=1.0)
    wf = search_r1.SearchR1Workflow(gconfig=gconfig, retriever_url=url, tokenizer_path=model_path, **kw)
    return (wf, *run_episodes(wf, engine, rows))


def test_episodes_mask_information_and_score_exact_match(engine, model_path, retriever, sink, tmp_path):
    rows = [dict(r) for r in load_search_dataset(size=12, seed=5)]
    wf, rec, results = episodes(engine, model_path, retriever.url, rows)
    tok = wf.tokenizer
    assert len(sink) == len(rows)
    assert sum(len(t.tool_returns()) for t in sink) > 0, "no episode searched"
    by_traj: dict[str, list] = {}
    for req in rec.requests:
        by_traj.setdefault(req.metadata["trajectory_id"], []).append(req)
    for row, res in zip(rows, results):
        ids = res["input_ids"][0].tolist()
        mask = res["loss_mask"][0].tolist()
        lp = res["logprobs"][0].tolist()
        ver = res["versions"][0].tolist()
        traj = next(t for t in sink if t.prompt_id == row["prompt_id"])
        reqs = by_traj[traj.trajectory_id]
        assert len(reqs) == len(traj.segments) and len(ids) == traj.final_length
        for k, req in enumerate(reqs):  # C-MLFQ's state: the tool returns so far, keyed by the tool
            assert req.metadata["tool_returns"] == [
                {"name": "search", "payload_tokens": t.payload_tokens, "status": t.status}
                for t in traj.tool_returns()[:k]
            ]
        pos = traj.prompt_tokens
        assert not any(mask[:pos])
        for seg in traj.segments:
            assert all(mask[pos : pos + seg.gen_tokens]) and all(v >= 0 for v in ver[pos : pos + seg.gen_tokens])
            pos += seg.gen_tokens
            if seg.tool is not None:
                assert seg.tool.name == "search" and seg.tool.status == "success"
                span = ids[pos : pos + seg.tool.payload_tokens]
                text = tok.decode(span)
                # The retrieved passages, loss-masked with logprob 0 and version -1.
                assert text.startswith(INFO_OPEN) and text.endswith(INFO_CLOSE) and ("was built in" in text or "meters tall" in text)
                assert not any(mask[pos : pos + len(span)]) and set(lp[pos : pos + len(span)]) == {0.0}
                assert set(ver[pos : pos + len(span)]) == {-1}
                pos += seg.tool.payload_tokens
        assert pos == len(ids)
        completion = tok.decode(ids[traj.prompt_tokens :], skip_special_tokens=True)
        assert float(res["rewards"][0]) == traj.reward == exact_match_reward("", completion, [], [], row["answer"])

    # The episodes as a trace in the repo's format replay through evaluation.routing.
    from evaluation.routing import main as routing_main


    path = tmp_path / "search.jsonl"
    write_traces(path, sink)
    assert [t.trajectory_id for t in read_traces(path)] == [t.trajectory_id for t in sink]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = routing_main(["--train", str(path), "--eval", str(path), "--buckets", "60,90,100000",
                           "--policies", "cmlfq,mlfq,oracle", "--json"])
    assert rc == 0
    report = json.loads(buf.getvalue())
    assert report["n_trajectories"] == len(rows)
    assert report["policies"]["oracle"]["decision_accuracy"] == 1.0
    for row in report["policies"].values():
        assert 0.0 <= row["decision_accuracy"] <= 1.0 and row["migrations_per_trajectory"] >= 0


def test_reward_is_exact_match():
    gold = "1937"
    assert exact_match_reward("", "<search>x</search><information>..</information><answer>1937</answer>", [], [], gold) == 1.0
    assert exact_match_reward("", "<answer>1936</answer>", [], [], gold) == 0.0
    assert exact_match_reward("", "<answer>19370</answer>", [], [], gold) == 0.0
    assert exact_match_reward("", "1937", [], [], gold) == 0.0  # no answer tags
    assert exact_match_reward("", "<answer>1</answer><answer> 1937.</answer>", [], [], gold) == 1.0  # the last one


def test_unreachable_retriever_is_a_tool_failure(engine, model_path, sink):
    rows = [dict(r) for r in load_search_dataset(size=4, seed=6)]
    _, _, results = episodes(engine, model_path, "http://127.0.0.1:9", rows, tool_timeout_s=2.0)
    assert len(results) == len(rows) == len(sink)
    tools = [t for traj in sink for t in traj.tool_returns()]
    assert tools and all(t.status == "failure" for t in tools)
