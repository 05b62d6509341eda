"""SGLang servers started as AReaL 1.0.4 starts them (areal/infra/launcher/sglang_server.py, local.py):
distinct --random-seed, HTTP and --dist-init-addr ports from each server's own range, and the NCCL
variables of the weight-update group in the trainer's environment. The flags themselves are parsed by
sglang's own ServerArgs in tests/sglang."""

from __future__ import annotations

from areal_libra import launch
from areal_libra.config import compose
from areal_libra.rollout import launcher
from areal_libra.rollout.launcher import ServerSpec, port_range
from areal_libra.rollout.placement import assign_gpus


class _Proc:
    pid = 0

    def poll(self):
        return None


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_port_ranges_are_areal_slices():
    ranges = [port_range(i, 4) for i in range(4)]
    assert ranges[0][0] == 10000 and ranges[-1][1] <= 32767
    assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))  # disjoint, in order


def test_servers_get_distinct_seeds_ports_and_dist_init(monkeypatch, tmp_path):
    c = compose(["cluster=gpu", f"cluster.fileroot={tmp_path}", "rollout_alloc=sglang:d2t1+d1t2", "seed=7"])
    specs = launch.server_specs(c)
    assert [s.seed for s in specs] == [7, 8, 9]
    started = []
    monkeypatch.setattr(launcher.subprocess, "Popen", lambda cmd, **kw: started.append(cmd) or _Proc())
    monkeypatch.setattr(launcher, "wait_healthy", lambda handles, timeout: None)
    p = assign_gpus([str(i) for i in range(5)], 1, [s.tp for s in specs])
    launcher.launch_servers("/m", specs, str(tmp_path), backend="sglang", env={}, placement=p)
    seeds = [_flag(cmd, "--random-seed") for cmd in started]
    ports = [int(_flag(cmd, "--port")) for cmd in started]
    dist = [_flag(cmd, "--dist-init-addr") for cmd in started]
    assert seeds == ["7", "8", "9"]
    for i, (port, addr) in enumerate(zip(ports, dist)):
        lo, hi = port_range(i, 3)
        host, dport = addr.rsplit(":", 1)
        assert host == "127.0.0.1" and lo <= port < hi and lo <= int(dport) < hi and int(dport) != port
    # The embedded CPU cluster keeps its servers' seed 0 and no dist-init flag.
    cpu = launch.server_specs(compose([f"cluster.fileroot={tmp_path}", "seed=7"]))
    assert {s.seed for s in cpu} == {0}
    assert "--dist-init-addr" not in launcher.build_command("embedded", "/m", ServerSpec(), "127.0.0.1", 1)


def test_trainer_env_has_the_nccl_variables_on_gpu(tmp_path):
    gpu = compose(["cluster=gpu", f"cluster.fileroot={tmp_path}"])
    env = launch.trainer_env(gpu, ["a:1"], ("0",), ("1",))
    assert env["NCCL_CUMEM_ENABLE"] == "0" and env["NCCL_NVLS_ENABLE"] == "0"
    import os

    if "NCCL_CUMEM_ENABLE" not in os.environ:  # a CPU run does not set them
        assert "NCCL_CUMEM_ENABLE" not in launch.trainer_env(compose([f"cluster.fileroot={tmp_path}"]), ["a:1"])
