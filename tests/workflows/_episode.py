"""Shared by the workflow tests: AReaL's own remote engine on a real server, and a recorder of its requests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def areal_engine(addr: str) -> Iterator[object]:
    """AReaL's RemoteSGLangEngine on the server at `addr` (the client path a live run uses)."""
    from areal.api.cli_args import InferenceEngineConfig
    from areal.engine.sglang_remote import RemoteSGLangEngine

    cfg = InferenceEngineConfig(experiment_name="t", trial_name="t", backend="sglang:d1", setup_timeout=30,
                                request_timeout=120, pause_grace_period=0.0, max_concurrent_rollouts=16,
                                consumer_batch_size=4)
    eng = RemoteSGLangEngine(cfg)
    eng.initialize(addr=[addr], train_data_parallel_size=1)
    try:
        yield eng
    finally:
        eng.destroy()


class Recorder:
    """Passes every request to AReaL's engine and keeps it (the dispatcher's view of the episode)."""

    def __init__(self, eng):
        self.eng = eng
        self.requests = []

    async def agenerate(self, req):
        self.requests.append(req)
        return await self.eng.agenerate(req)

    def get_version(self):
        return self.eng.get_version()


def tiny_policy(name: str, task: str = "math", tool_only: bool = True) -> object:
    """The workflow tests' policy: tiny, warmed up briefly on demonstrations (only tool-calling ones when
    `tool_only`), so that its episodes do call the tool."""
    from areal_libra.models.shape import Qwen2Shape
    from areal_libra.models.tiny import TinyModelConfig
    from areal_libra.models.warmup import WarmupConfig

    extra = {"tool_fraction": 1.0, "corrupt_fraction": 0.0} if tool_only else {}
    shape = Qwen2Shape(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1)
    return TinyModelConfig(name=name, shape=shape, tokenizer_corpus_problems=300,
                           warmup=WarmupConfig(steps=60, batch_size=16, lr=5e-3, **extra), probe_episodes=0,
                           task=task)


@contextmanager
def served_engine(model_path: str) -> Iterator[object]:
    """AReaL's engine on an in-process embedded server of `model_path`."""
    from areal_libra.server.inprocess import InProcessServer

    srv = InProcessServer(model_path, max_running_requests=32, seed=0)
    try:
        with areal_engine(srv.addr) as eng:
            yield eng
    finally:
        srv.close()


@contextmanager
def collected_trajectories() -> Iterator[list]:
    """Every episode the workflows finish meanwhile, through the shared trajectory sink."""
    from areal_libra.workflows.sink import set_trajectory_sink

    got: list = []
    set_trajectory_sink(got.append)
    try:
        yield got
    finally:
        set_trajectory_sink(None)


def run_episodes(wf, engine, rows: list[dict]) -> tuple[Recorder, list]:
    """All `rows` as concurrent episodes of workflow `wf`; the recorder of their requests and the results."""
    import asyncio

    rec = Recorder(engine)

    async def go():
        return await asyncio.gather(*[wf.arun_episode(rec, row) for row in rows])

    return rec, asyncio.run(go())
