"""experiment=search_r1's wiring, without a training run: the composed config, the retrieval server the
launch starts (a real process) or checks, the trainer's dataset and workflow arguments."""

from __future__ import annotations

import re

import pytest
from omegaconf import OmegaConf

from areal_libra.config import ConfigError, compose
from areal_libra.launch import LaunchError, start_retriever
from areal_libra.workflows.retriever import is_healthy
from areal_libra.workflows.search_corpus import corpus


def test_composed_config():
    c = compose(["experiment=search_r1"])
    assert c.libra.workflow == "areal_libra.workflows.search_r1.SearchR1Workflow"
    assert c.libra.tools.retriever_url == "local" and c.libra.model.task == "search_r1"
    assert c.areal.experiment_name == "search-r1"


@pytest.mark.parametrize("override", ["libra.tools.retriever_url=ftp://x", "libra.tools.retriever_topk=0",
                                      "libra.model.task=nope"])
def test_bad_settings_are_config_errors(override):
    if override.endswith("nope"):  # checked when the model is resolved
        from areal_libra.launch import resolve_model

        with pytest.raises(LaunchError, match="libra.model.task"):
            resolve_model(compose(["experiment=search_r1", override]))
        return
    with pytest.raises(ConfigError, match="tools"):
        compose(["experiment=search_r1", override])


def test_launch_starts_and_stops_the_local_retriever(tmp_path):
    c = compose(["experiment=search_r1"])
    proc = start_retriever(c, tmp_path)
    try:
        assert c.libra.tools.retriever_url == proc.url and is_healthy(proc.url)
        assert (tmp_path / "retriever.log").exists()
    finally:
        proc.stop()
    assert not proc.alive() and not is_healthy(proc.url, timeout_s=1.0)


def test_a_given_url_must_answer(tmp_path):
    c = compose(["experiment=search_r1", "libra.tools.retriever_url=http://127.0.0.1:9"])
    with pytest.raises(LaunchError, match="does not answer POST /retrieve"):
        start_retriever(c, tmp_path)


def test_trainer_dataset_and_workflow_arguments():
    from areal_libra.live.train import build_dataset
    from areal_libra.workflows.search_r1 import SearchR1Workflow

    c = compose(["experiment=search_r1", "libra.dataset.n_problems=50"])
    rows = build_dataset(c.libra, c.areal)
    assert len(rows) == 50
    texts = [r["contents"] for r in corpus()]
    for row in rows:  # every answer is in a passage about the question's entity, on the fact asked for
        question = row["messages"][-1]["content"]
        number = re.search(r"\b\d{5}\b", question).group()
        fact = "built" if "built" in question else "tall"
        assert [t for t in texts if number in t and fact in t and row["answer"] in t]
    libra = OmegaConf.merge(c.libra, {"tools": {"retriever_url": "http://127.0.0.1:1234"}})
    assert SearchR1Workflow.libra_kwargs(libra) == {"retriever_url": "http://127.0.0.1:1234", "topk": 2,
                                                   "tool_timeout_s": 5.0}


def test_a_dying_retriever_stops_the_run(tmp_path):
    """The launch's supervisor stops the trainer and fails in one line when the retrieval server dies."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from areal_libra.launch import supervise
    from areal_libra.workflows.retriever import RetrieverProcess

    retriever = RetrieverProcess(tmp_path / "retriever.log")
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.killpg(retriever.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(LaunchError, match="tool server died; see .*retriever.log"):
            supervise(trainer, tmp_path / "metrics.jsonl", 2, [], quiet=True, run_dir=tmp_path,
                      tool_servers=[retriever])
        assert trainer.wait(timeout=10) != 0 and time.monotonic() - t0 < 10
    finally:
        trainer.kill()
        retriever.stop()
