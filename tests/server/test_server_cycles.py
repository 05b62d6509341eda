"""Served requests and replaced KV caches are freed by reference counting alone, not left in reference
cycles for Python's rare full collection (in the soak such cycles held up to ~400 MiB per server between
collections: evaluation/figures/server_memory*.json). Each test runs with the cyclic collector off."""

from __future__ import annotations

import concurrent.futures as cf
import gc
import weakref
from collections.abc import Iterator

import pytest
import torch

from areal_libra.server.batching import Request
from areal_libra.server.inprocess import InProcessServer, http
from areal_libra.server.kv_cache import SlotKVCache


@pytest.fixture
def no_cyclic_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_replaced_kv_cache_is_freed_without_the_collector(no_cyclic_gc):
    cache = SlotKVCache(num_layers=2, kv_heads=2, head_dim=4, dtype=torch.float32)
    cache.add_rows(3)
    cache.ensure_step_room(8)
    gone = weakref.ref(cache)
    del cache
    assert gone() is None


def _live_requests() -> int:
    return sum(1 for o in gc.get_objects() if type(o) is Request)


def test_finished_requests_are_freed_without_the_collector(tiny_model_pair, no_cyclic_gc):
    srv = InProcessServer(tiny_model_pair[0], max_running_requests=16, seed=0)
    try:
        def one(i: int) -> int:
            body = {"input_ids": [3 + i, 5, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 1.0}}
            return http(srv.addr, "/generate", body)[0]

        before = _live_requests()
        with cf.ThreadPoolExecutor(8) as ex:
            assert set(ex.map(one, range(32))) == {200}
        assert _live_requests() - before == 0
        status, body = http(srv.addr, "/update_weights_from_disk", {"model_path": tiny_model_pair[1]})
        assert status == 200 and body["success"]
        # The weight update ran one full collection (what cycles remain elsewhere, e.g. closed transports).
        info = http(srv.addr, "/get_server_info")[1]
        assert info["gc_after_update"]["collections"] == 1
    finally:
        srv.close()
