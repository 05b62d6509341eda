"""Patch 11: xccl weight-update ranks follow the real server sizes (mixed TP); unchanged when off."""

from areal.api.alloc_mode import ModelAllocation
from areal.api.io_struct import WeightUpdateMeta
from areal.engine.sglang_remote import SGLangBackend

from areal_libra.engine.groups import parse_allocation, server_sizes, xccl_rank_offsets


def _payloads(meta: WeightUpdateMeta, n: int) -> list[dict]:
    meta.nccl_master_address, meta.nccl_master_port, meta.nccl_group_name = "127.0.0.1", 29500, "update_weight_group"
    be = SGLangBackend()
    return [be.build_init_weights_group_request(f"s{i}:1", i, meta).payload for i in range(n)]


def test_mixed_tp_rank_offsets_sum_real_sizes() -> None:
    _, groups = parse_allocation("sglang:d2t1+d1t2+d1t4")
    sizes = server_sizes(groups)
    # AReaL's rollout allocation only says how many GPUs the fleet has
    meta = WeightUpdateMeta.from_fsdp_xccl(ModelAllocation.from_str(f"sglang:d{sum(sizes)}t1"))
    meta.gen_server_sizes = sizes
    got = _payloads(meta, len(sizes))
    offsets, world = xccl_rank_offsets(sizes)
    assert [p["rank_offset"] for p in got] == offsets == [1, 2, 3, 5]
    assert {p["world_size"] for p in got} == {world} == {9}
    # every TP rank of every server gets its own rank in [1, world): no overlap, no gap
    ranks = sorted(p["rank_offset"] + r for p, s in zip(got, sizes) for r in range(s))
    assert ranks == list(range(1, world))


def test_without_sizes_the_payload_is_areal_s_original() -> None:
    meta = WeightUpdateMeta.from_fsdp_xccl(ModelAllocation.from_str("sglang:d2t2"))
    got = _payloads(meta, 2)
    assert [(p["rank_offset"], p["world_size"]) for p in got] == [(1, 5), (3, 5)]
    assert meta.gen_server_sizes is None
