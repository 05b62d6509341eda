"""MathToolWorkflow against the real inference path: the embedded SGLang-API server on loopback, driven by
AReaL 1.0.4's own RemoteSGLangEngine (the client the trainer uses)."""

from __future__ import annotations

import pytest
import torch

from areal_libra.models.tiny import ensure_model
from areal_libra.workflows import math_tool
from areal_libra.workflows.markup import RESULT_CLOSE, RESULT_OPEN
from areal_libra.workflows.math_data import generated_dataset
from areal_libra.workflows.reward import dapo_math_reward
from tests.workflows._episode import collected_trajectories, run_episodes, served_engine, tiny_policy

TOOL_USER = tiny_policy("test-tool-user")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(ensure_model(cache_dir=tmp_path_factory.mktemp("cache"), config=TOOL_USER, quiet=True))


@pytest.fixture(scope="module")
def engine(model_path):
    with served_engine(model_path) as eng:
        yield eng


def _gconfig():
    from areal.api.cli_args import GenerationHyperparameters

    return GenerationHyperparameters(n_samples=1, max_new_tokens=32, max_tokens=160, temperature=1.0)


@pytest.fixture
def sink():
    with collected_trajectories() as got:
        yield got


def episodes(engine, model_path, rows, **kw):
    wf = math_tool.MathToolWorkflow(gconfig=_gconfig(), tokenizer_path=model_path, **kw)
    return (wf, *run_episodes(wf, engine, rows))


def test_episodes_turns_masks_metadata_and_trace(engine, model_path, sink):
    rows = [dict(r) for r in generated_dataset(12, seed=5)]
    wf, rec, results = episodes(engine, model_path, rows)
    tok = wf.tokenizer
    assert len(sink) == len(rows)
    by_traj: dict[str, list] = {}
    for req in rec.requests:
        by_traj.setdefault(req.metadata["trajectory_id"], []).append(req)
    assert len({r.rid for r in rec.requests}) == len(rec.requests), "a fresh rid per turn"
    assert sum(len(t.tool_returns()) for t in sink) > 0, "no episode called the tool"
    for row, res, in zip(rows, results):
        ids = res["input_ids"][0].tolist()
        mask = res["loss_mask"][0].tolist()
        lp = res["logprobs"][0].tolist()
        ver = res["versions"][0].tolist()
        assert res["input_ids"].shape == res["loss_mask"].shape == res["attention_mask"].shape
        traj = next(t for t in sink if t.prompt_id == row["prompt_id"])
        reqs = by_traj[traj.trajectory_id]
        # One /generate per segment; each re-sends the whole context so far.
        assert len(reqs) == len(traj.segments)
        assert len(ids) == traj.final_length and sum(mask) == traj.model_tokens
        for k, req in enumerate(reqs):
            md = req.metadata
            assert md["turn"] == k and md["prompt_id"] == row["prompt_id"]
            assert md["prompt_tokens"] == traj.prompt_tokens
            assert md["context_tokens"] == len(req.input_ids) == (traj.context_after(k - 1) if k else traj.prompt_tokens)
            assert md["model_tokens"] == sum(s.gen_tokens for s in traj.segments[:k])
            assert md["tool_returns"] == [
                {"name": t.name, "payload_tokens": t.payload_tokens, "status": t.status}
                for t in traj.tool_returns()[:k]
            ]
            assert ids[: len(req.input_ids)] == req.input_ids
        # Model tokens are trained on; prompt and tool results are masked with logprob 0, version -1.
        pos = traj.prompt_tokens
        assert not any(mask[:pos]) and all(v == -1 for v in ver[:pos])
        for seg in traj.segments:
            assert all(mask[pos : pos + seg.gen_tokens]) and all(v >= 0 for v in ver[pos : pos + seg.gen_tokens])
            assert all(x < 0 for x in lp[pos : pos + seg.gen_tokens])
            pos += seg.gen_tokens
            if seg.tool is not None:
                span = ids[pos : pos + seg.tool.payload_tokens]
                text = tok.decode(span)
                assert text.startswith(RESULT_OPEN) and text.endswith(RESULT_CLOSE)
                assert not any(mask[pos : pos + len(span)]) and set(lp[pos : pos + len(span)]) == {0.0}
                assert set(ver[pos : pos + len(span)]) == {-1}
                pos += seg.tool.payload_tokens
        assert pos == len(ids)
        # The reward is the DAPO reward of the decoded completion.
        completion = tok.decode(ids[traj.prompt_tokens :], skip_special_tokens=True)
        assert float(res["rewards"][0]) == traj.reward == dapo_math_reward("", completion, [], [], row["answer"])
        assert traj.finish_reason in ("stop", "length")


def test_tool_timeouts_are_outcomes(engine, model_path, sink):
    rows = [dict(r) for r in generated_dataset(6, seed=6)]
    wf, _, results = episodes(engine, model_path, rows, tool_timeout_s=1e-6, tool_workers=1)
    assert len(results) == len(rows) == len(sink)
    statuses = [t.status for traj in sink for t in traj.tool_returns()]
    assert statuses and set(statuses) == {"timeout"}
    by_prompt = {t.prompt_id: t for t in sink}
    for row, res in zip(rows, results):
        traj = by_prompt[row["prompt_id"]]
        assert res["input_ids"].shape[1] == traj.final_length
        if traj.tool_returns():
            text = wf.tokenizer.decode(res["input_ids"][0].tolist())
            assert "TimeoutError" in text  # the error text is what the model sees


def test_grouped_through_areal_rollout_batch(engine, model_path, sink):
    """AReaL wraps the workflow in GroupedRolloutWorkflow: n_samples episodes per prompt, one GRPO group."""
    from areal.utils import stats_tracker

    stats_tracker.export_all(reset=True)
    rows = [dict(r) for r in generated_dataset(3, seed=7)]
    out = engine.rollout_batch(
        rows,
        workflow="areal_libra.workflows.math_tool.MathToolWorkflow",
        workflow_kwargs={"gconfig": _gconfig(), "tokenizer_path": model_path, "max_turns": 3},
        group_size=4,
    )
    assert len(out) == 3 and all(o["input_ids"].shape[0] == 4 for o in out)
    assert len(sink) == 12
    groups = {}
    for t in sink:
        groups.setdefault(t.prompt_id, set()).add(t.trajectory_id)
    assert sorted(len(v) for v in groups.values()) == [4, 4, 4]
    stats = stats_tracker.export_all(reset=True)
    for key in ("reward", "num_turns", "tool_calls", "tool_failures", "tool_timeouts", "gen_tokens"):
        assert f"rollout/{key}" in stats, sorted(stats)
    assert stats["rollout/gen_tokens"] == pytest.approx(sum(t.model_tokens for t in sink) / 12)
    assert torch.isfinite(torch.tensor(stats["rollout/reward"]))
