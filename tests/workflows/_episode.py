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
