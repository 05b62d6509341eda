"""SGLang as one more ServerBackend (rollout/backend.SGLangBackend): the servers the fleet starts after the
launch get a seed, a port slice and a dist-init address of their own, distinct from the launch's. SGLang
cannot serve here, so the command lines are checked (and parsed by the pinned SGLang's own ServerArgs where
its module imports: tests/sglang)."""

from __future__ import annotations

import socket

from areal_libra.rollout import backend as backend_mod
from areal_libra.rollout.backend import LocalProcessBackend, SGLangBackend, backend_for_device
from areal_libra.rollout.launcher import ServerSpec, build_command, port_range, ports_in_range

NODE = tuple(str(i) for i in range(8))


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def _launch_commands(seed: int, specs: list[ServerSpec]) -> list[list[str]]:
    """What the launch starts (launch.server_specs' seeds: seed + i; launch_servers' port slices: i of n)."""
    out = []
    for i, spec in enumerate(specs):
        port, dist = ports_in_range(2, *port_range(i, len(specs)))
        spec = ServerSpec(tp=spec.tp, group=spec.group, seed=seed + i)
        out.append(build_command("sglang", "/models/m", spec, "127.0.0.1", port, dist_init_port=dist))
    return out


def _hold(ports: list[int]) -> list[socket.socket]:
    """Bind `ports` as the launched servers do while they run (their HTTP port and the rendezvous store)."""
    socks = []
    for port in ports:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind(("127.0.0.1", port))
        socks.append(s)
    return socks


def test_fleet_started_servers_get_their_own_seed_ports_and_dist_init_addr() -> None:
    launched = _launch_commands(7, [ServerSpec(tp=1, group="g0")] * 2)  # two TP1 servers at launch
    # The launched servers hold their ports while the fleet picks its own (without that, a fleet port drawn from
    # a slice that overlaps a launched server's could equal one the test released, about once in 1,000 runs).
    held = _hold([int(_flag(c, f)) if f == "--port" else int(_flag(c, f).rsplit(":", 1)[1])
                  for c in launched for f in ("--port", "--dist-init-addr")])
    try:
        be = SGLangBackend(seed=7, first_index=2, node_devices=NODE)
        first = be.commands("/ckpt", [ServerSpec(tp=2, group="long"), ServerSpec(tp=1, group="short")],
                            devices=[("4", "5"), ("6",)])
        later = be.commands("/ckpt", [ServerSpec(tp=1, group="short")], devices=[("7",)])  # e.g. a revive
    finally:
        for sock in held:
            sock.close()
    fleet = first + later
    assert all(c[1:3] == ["-m", "sglang.launch_server"] for c in fleet)
    seeds = [int(_flag(c, "--random-seed")) for c in launched + fleet]
    assert seeds == [7, 8, 9, 10, 11]  # counting on after the launch's
    ports = [int(_flag(c, "--port")) for c in launched + fleet]
    dists = [_flag(c, "--dist-init-addr") for c in launched + fleet]
    assert len(set(ports)) == len(ports) and len(set(dists)) == len(dists)
    assert not set(ports) & {int(d.rsplit(":", 1)[1]) for d in dists}
    # each fleet server's two ports lie in the slice of its first device (8 devices: 8 slices)
    for cmd, dev in zip(fleet, [4, 6, 7]):
        lo, hi = port_range(dev, len(NODE))
        assert lo <= int(_flag(cmd, "--port")) < hi and lo <= int(_flag(cmd, "--dist-init-addr").rsplit(":")[1]) < hi
    assert [_flag(c, "--tp-size") for c in fleet] == ["2", "1", "1"]
    assert [_flag(c, "--model-path") for c in fleet] == ["/ckpt"] * 3


def test_start_hands_the_launcher_those_seeds_ports_and_devices(monkeypatch, tmp_path) -> None:
    got = {}

    def launch(weights, specs, log_dir, backend, host, timeout, placement, ports):
        got.update(weights=weights, seeds=[s.seed for s in specs], backend=backend, devices=placement.servers,
                   ports=ports)
        return []

    monkeypatch.setattr(backend_mod, "launch_servers", launch)
    be = SGLangBackend(seed=100, first_index=4, node_devices=NODE)
    be.start("/ckpt/v3", [ServerSpec(tp=2), ServerSpec(tp=1)], str(tmp_path), devices=[("2", "3"), ("5",)],
             weight_version=3)
    assert got["backend"] == "sglang" and got["weights"] == "/ckpt/v3" and got["seeds"] == [104, 105]
    assert got["devices"] == (("2", "3"), ("5",)) and be.started == 2
    (p0, d0), (p1, d1) = got["ports"]
    assert port_range(2, 8)[0] <= min(p0, d0) and max(p0, d0) < port_range(2, 8)[1] and p0 != d0
    assert port_range(5, 8)[0] <= min(p1, d1) and max(p1, d1) < port_range(5, 8)[1] and p1 != d1


def test_the_fleet_picks_sglang_on_cuda_and_the_embedded_server_elsewhere() -> None:
    be = backend_for_device("cuda", seed=5, first_index=3)
    assert isinstance(be, SGLangBackend) and be.name == "sglang" and be.places_devices
    assert (be.seed, be.first_index) == (5, 3)
    assert backend_for_device("cpu") == LocalProcessBackend("embedded")


def test_fleet_command_lines_parse_with_sglangs_server_args() -> None:
    from tests.sglang.test_command_lines import parse_with_sglang

    be = SGLangBackend(seed=1, first_index=1, node_devices=NODE)
    cmds = be.commands("/models/Qwen3-8B", [ServerSpec(tp=t) for t in (1, 2, 4)],
                       devices=[("1",), ("2", "3"), ("4", "5", "6", "7")])
    for cmd, ns in zip(cmds, parse_with_sglang([c[3:] for c in cmds]), strict=True):
        assert ns["random_seed"] == int(_flag(cmd, "--random-seed")) and ns["dist_init_addr"] == _flag(cmd, "--dist-init-addr")
        assert ns["tp_size"] == int(_flag(cmd, "--tp-size"))
