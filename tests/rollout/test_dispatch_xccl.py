"""Patch 11: xccl weight-update ranks follow the real server sizes (mixed TP); unchanged when off."""

from areal.api.alloc_mode import ModelAllocation
from areal.api.io_struct import WeightUpdateMeta
from areal.engine.sglang_remote import SGLangBackend

from areal_libra.rollout.groups import parse_allocation, server_sizes, xccl_rank_offsets


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


_MEMBER = r"""
import sys, torch, torch.distributed as dist
rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
t = torch.arange(4.0) if rank == 0 else torch.zeros(4)
dist.broadcast(t, src=0)  # the trainer (rank 0) sends, every server TP rank receives
print("GOT", rank, t.tolist(), flush=True)
dist.destroy_process_group()
"""


def test_rank_offsets_form_one_complete_group_over_gloo() -> None:
    """The payloads' ranks (offset + tp rank per server, trainer 0) join one process group and all receive a
    broadcast: what /init_weights_update_group does on GPU with NCCL, run here with gloo."""
    import subprocess
    import sys

    from areal_libra.utils import free_port

    sizes = [2, 1]  # a TP2 server, then a TP1 server: three inference ranks + the trainer
    meta = WeightUpdateMeta.from_fsdp_xccl(ModelAllocation.from_str(f"sglang:d{sum(sizes)}t1"))
    # AReaL's own formula (equal servers) would give the TP1 server rank 2, which the TP2 server also holds
    plain = [p["rank_offset"] for p in _payloads(meta, len(sizes))]
    assert plain == [1, 2]
    meta.gen_server_sizes = sizes
    pays = _payloads(meta, len(sizes))
    world = pays[0]["world_size"]
    ranks = [0] + [p["rank_offset"] + r for p, s in zip(pays, sizes) for r in range(s)]
    assert sorted(ranks) == list(range(world))
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", _MEMBER, str(r), str(world), port],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in ranks]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    got = sorted(line for o in outs for line in o.splitlines() if line.startswith("GOT"))
    assert got == [f"GOT {r} [0.0, 1.0, 2.0, 3.0]" for r in range(world)]
