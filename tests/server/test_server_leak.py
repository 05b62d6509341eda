"""The embedded server as a real subprocess: it listens on 127.0.0.1 unless told otherwise, and 10,000 bad
requests do not grow its memory (resident set size of the server process, read from /proc)."""

from __future__ import annotations

import inspect
import json
import time

import pytest

from tests.server.test_server_fuzz import Client

N_WARMUP = 1_000
N_BAD = 10_000
# Growth allowed after the warm-up. Measured: +0 kB without a leak; keeping each error message (~350 bytes
# per bad request, injected on purpose in a scratch copy) grew it by 2444 kB. 1 MB = ~100 bytes per request.
MAX_GROWTH_KB = 1_024

BAD: list[tuple[str, bytes]] = [
    ("/generate", b"{not json"),
    ("/generate", b"\xff\xfe{"),
    ("/generate", b"[" * 5_000),
    ("/generate", b"[1, 2]"),
    ("/generate", b'{"input_ids": [3, -1]}'),
    ("/generate", b'{"input_ids": [3, 100000000000000000000000]}'),
    ("/generate", json.dumps({"input_ids": [5] * 3_000}).encode()),  # beyond the 2048-token context
    ("/generate", b'{"input_ids": [3], "sampling_params": {"max_new_tokens": -5}}'),
    ("/generate", b'{"input_ids": [3], "sampling_params": {"temperature": NaN}}'),
    ("/generate", b'{"input_ids": [3], "sampling_params": {"top_k": "x", "bogus": 1}}'),
    ("/generate", b'{"text": "\\udcff"}'),
    ("/generate", json.dumps({"text": "x" * 60_000}).encode()),
    ("/generate", b'{"input_ids": [3], "stream": true}'),
    ("/pause_generation", b'{"mode": "sideways"}'),
    ("/continue_generation", b"garbage"),
    ("/abort_request", b'{"rid": 5}'),
    ("/abort_request", b'{"rid": "no-such-request"}'),  # unknown rid: a no-op 200, as in SGLang
    ("/update_weights_from_disk", b'{"model_path": "/nonexistent"}'),
    ("/update_weights_from_disk", b'{"model_path": 3}'),
    ("/init_weights_update_group", b"{}"),
]


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def listening_hosts(port: int) -> set[str]:
    """Local addresses of the TCP sockets listening on ``port`` (from /proc/net/tcp and tcp6)."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = open(table).read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            addr, p = local.split(":")
            if state == "0A" and int(p, 16) == port:  # 0A = LISTEN
                out.add(".".join(str(b) for b in reversed(bytes.fromhex(addr))) if len(addr) == 8 else addr)
    return out


@pytest.fixture(scope="module")
def server(tiny_model_dir, embedded_servers):
    from areal_libra.rollout.launcher import ServerSpec

    return embedded_servers(tiny_model_dir, [ServerSpec(max_running=8)])[0]


def test_servers_listen_on_loopback_by_default(server, tiny_model_dir):
    from areal_libra.rollout.launcher import launch_servers
    from areal_libra.server.embedded_server import ServerArgs, parse_args
    from areal_libra.server.inprocess import InProcessServer

    port = int(server.addr.rsplit(":", 1)[1])
    assert server.addr.startswith("127.0.0.1:")
    assert listening_hosts(port) == {"127.0.0.1"}
    assert inspect.signature(launch_servers).parameters["host"].default == "127.0.0.1"
    assert ServerArgs(model_path="m").host == "127.0.0.1"
    assert "127.0.0.1" in inspect.getsource(InProcessServer._run)
    assert parse_args(["--model-path", tiny_model_dir]).host == "127.0.0.1"


def test_10k_bad_requests_do_not_grow_memory(server):
    pid = server.proc.pid
    client = Client(server.addr)
    statuses: dict[int, int] = {}

    def blast(n: int) -> None:
        for i in range(n):
            path, raw = BAD[i % len(BAD)]
            status, _, _ = client.send(path, raw)
            statuses[status] = statuses.get(status, 0) + 1

    blast(N_WARMUP)
    before = rss_kb(pid)
    t0 = time.perf_counter()
    blast(N_BAD)
    elapsed = time.perf_counter() - t0
    after = rss_kb(pid)
    status, raw, _ = client.send("/generate", b'{"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 4}}')
    print(f"bad requests: {N_WARMUP} warm-up + {N_BAD} in {elapsed:.1f} s; statuses {statuses}; "
          f"server RSS {before} kB -> {after} kB ({after - before:+d} kB)")
    assert server.alive() and status == 200 and len(json.loads(raw)["output_ids"]) == 4
    assert set(statuses) == {200, 400}  # 200 only for the unknown rid
    assert statuses[200] == (N_WARMUP + N_BAD) // len(BAD)
    assert after - before < MAX_GROWTH_KB, f"server RSS grew by {after - before} kB over {N_BAD} bad requests"
