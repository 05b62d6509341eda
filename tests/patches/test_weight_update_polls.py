"""Patch 16 on the installed AReaL: the disk weight update, which runs while every rollout server is paused,
sees the trainer's save within a fine poll instead of AReaL's 1-second name-resolve poll, and a turn the update
interrupted is sent again within 50 ms of the resume instead of AReaL's 0.5 s."""

import threading
import time
from datetime import datetime

from areal.api.cli_args import NameResolveConfig
from areal.api.io_struct import WeightUpdateMeta
from areal.engine.sglang_remote import SGLangBackend
from areal.infra.remote_inf_engine import _update_weights_from_disk
from areal.utils import name_resolve, names


def test_disk_update_follows_the_save_within_a_fine_poll(tmp_path) -> None:
    name_resolve.reconfigure(NameResolveConfig(type="nfs", nfs_record_root=str(tmp_path / "names")))
    name = names.update_weights_from_disk("exp", "trial", 3)
    save_s = 0.3

    def save() -> None:  # the trainer: writes the weights, then publishes the name
        time.sleep(save_s)
        name_resolve.add(name, str(datetime.now().timestamp()), replace=True)

    saver = threading.Thread(target=save)
    t0 = time.perf_counter()
    saver.start()
    _update_weights_from_disk(SGLangBackend(), "exp", "trial", 3, [],
                              WeightUpdateMeta(type="disk", path=str(tmp_path / "w")), 1, 10.0)
    waited = time.perf_counter() - t0
    saver.join()
    # Unpatched, the first poll misses the save and the next comes a second later (>= 1.0 s in all).
    assert save_s <= waited < 0.8, waited


def test_an_interrupted_turn_resumes_within_a_fine_poll(tiny_model_dir, embedded_servers) -> None:
    # AReaL's weight update pauses the executor and the servers (the turn comes back aborted), and agenerate
    # waits while the executor is paused. Resume the moment it starts waiting: the turn is sent again within
    # the patched 0.05 s poll, where unpatched it sleeps out its 0.5 s.
    import asyncio

    from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig
    from areal.api.io_struct import ModelRequest
    from areal.engine.sglang_remote import RemoteSGLangEngine

    from areal_libra.rollout.launcher import ServerSpec

    (server,) = embedded_servers(tiny_model_dir, [ServerSpec(tp=1, threads=1, max_running=8)])
    eng = RemoteSGLangEngine(InferenceEngineConfig(backend="sglang:d1t1", experiment_name="poll", trial_name="t",
                                                   setup_timeout=60, request_timeout=60))
    eng.initialize(addr=[server.addr])
    inner = eng._engine
    sends: list[float] = []
    waiting = threading.Event()
    build, is_paused = inner.backend.build_generation_request, inner.workflow_executor.is_paused

    def build_spy(*args, **kwargs):  # each (re)send of the turn builds its request here
        sends.append(time.monotonic())
        return build(*args, **kwargs)

    def is_paused_spy() -> bool:
        paused = is_paused()
        if paused:
            waiting.set()
        return paused

    inner.backend.build_generation_request = build_spy
    inner.workflow_executor.is_paused = is_paused_spy
    req = ModelRequest(rid="long-turn", input_ids=[5, 7, 9, 11],
                       gconfig=GenerationHyperparameters(max_new_tokens=1500, max_tokens=2000, ignore_eos=True))
    result: dict = {}
    turn = threading.Thread(target=lambda: result.update(resp=asyncio.run(eng.agenerate(req))), daemon=True)
    try:
        turn.start()
        deadline = time.monotonic() + 30
        while not sends and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.3)  # the turn is decoding
        eng.pause()  # as AReaL's trainer does before a weight update: the executor, then the servers
        eng.pause_generation()  # aborts the turn
        assert waiting.wait(30), f"the interrupted turn never waited for the pause (it ended: {result})"
        eng.continue_generation()
        eng.resume()
        resumed = time.monotonic()
        deadline = resumed + 5
        while len(sends) < 2 and time.monotonic() < deadline:
            time.sleep(0.002)
        assert len(sends) >= 2, "the turn was not sent again"
        assert sends[1] - resumed < 0.25, sends[1] - resumed
        turn.join(120)  # the turn completes: nothing is left running against the server when the module ends
        assert not turn.is_alive() and result["resp"].stop_reason == "length", result
    finally:
        eng.destroy()
