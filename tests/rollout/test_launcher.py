"""Server launcher: real subprocesses of the embedded server on loopback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from areal_libra.rollout.launcher import (
    ServerLaunchError,
    ServerSpec,
    build_command,
    launch_servers,
    resolve_backend,
    server_infos,
    shutdown,
)
from areal_libra.server.inprocess import http
from areal_libra.utils import free_ports, pid_alive


def test_two_servers_serve_report_spec_and_shut_down(tiny_model_dir, tmp_path):
    specs = [ServerSpec(tp=1, threads=1, max_running=16, group="small"), ServerSpec(tp=2, max_running=8, group="big")]
    handles = launch_servers(tiny_model_dir, specs, str(tmp_path / "logs"), backend="embedded", timeout=120)
    try:
        assert len({h.addr for h in handles}) == 2
        for h, spec in zip(handles, specs):
            assert h.alive() and h.backend == "embedded"
            status, info = http(h.addr, "/get_server_info")
            assert info["tp_size"] == spec.tp and info["max_running_requests"] == spec.max_running
            status, out = http(h.addr, "/generate", {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 4}})
            assert status == 200 and out["meta_info"]["completion_tokens"] == 4
            assert spec.group in h.log_path and "ready" in open(h.log_path).read()
        infos = server_infos(handles)
        assert [f"{i.host}:{i.port}" for i in infos] == [h.addr for h in handles]
        handles[0].kill()  # fault injection: the other server keeps serving
        assert not handles[0].alive() and handles[1].alive()
        assert http(handles[1].addr, "/health")[0] == 200
    finally:
        shutdown(handles)
    assert not any(h.alive() for h in handles)
    assert handles[1].proc.returncode == 0  # SIGTERM → clean exit


def test_dead_server_fails_launch_with_its_log(tmp_path):
    (tmp_path / "notamodel").mkdir()
    with pytest.raises(ServerLaunchError) as ei:
        launch_servers(
            str(tmp_path / "notamodel"), [ServerSpec()], str(tmp_path / "logs"), backend="embedded", timeout=120
        )
    msg = str(ei.value)
    assert "exited with code 1" in msg and "not a Hugging Face model directory" in msg


def test_timeout_stops_started_servers(tiny_model_dir, tmp_path):
    with pytest.raises(ServerLaunchError, match="not healthy after"):
        launch_servers(tiny_model_dir, [ServerSpec()], str(tmp_path / "logs"), backend="embedded", timeout=0.5)
    # every process started for this launch is gone (the launcher killed its session)
    out = subprocess.run(["pgrep", "-f", f"--model-path {tiny_model_dir} "], capture_output=True, text=True)
    assert out.stdout.strip() == ""


def test_commands_and_backend_choice():
    spec = ServerSpec(tp=4, max_running=64, seed=3, max_total_tokens=9000)
    cmd = build_command("sglang", "/m", spec, "127.0.0.1", 1234, base_gpu_id=4)
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags == {
        "--model-path": "/m",
        "--host": "127.0.0.1",
        "--port": "1234",
        "--tp-size": "4",
        "--base-gpu-id": "4",
        "--max-running-requests": "64",
        "--random-seed": "3",
        "--log-level": "warning",
        "--max-total-tokens": "9000",
    }
    cmd = build_command("embedded", "/m", spec, "127.0.0.1", 1234)
    assert "areal_libra.server.embedded_server" in cmd and cmd[cmd.index("--tp-size") + 1] == "4"
    assert resolve_backend("auto") == "embedded"  # no CUDA/sglang on this machine
    with pytest.raises(ValueError):
        resolve_backend("vllm")
    a, b = free_ports(2)
    assert a != b


def test_server_cli_bad_input_is_one_line(tmp_path):
    for argv, needle in (
        (["--model-path", str(tmp_path), "--port", "0"], "--port"),
        (["--model-path", str(tmp_path), "--threads", "0"], "--threads"),
        (["--model-path", str(tmp_path), "--port", "31001"], "not a Hugging Face model"),
        (["--port", "1"], "--model-path"),
    ):
        r = subprocess.run(
            [sys.executable, "-m", "areal_libra.server.embedded_server", *argv],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode != 0
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr, r.stderr


def test_server_exits_when_its_launcher_dies(tiny_model_dir, tmp_path):
    """A launcher killed with SIGKILL cannot shut its servers down; they notice and exit by themselves."""
    import os
    import signal
    import time

    script = (
        "import sys, time\n"
        "from areal_libra.rollout.launcher import ServerSpec, launch_servers\n"
        f"h = launch_servers({tiny_model_dir!r}, [ServerSpec()], {str(tmp_path / 'logs')!r}, backend='embedded', timeout=120)\n"
        "print(h[0].proc.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        server_pid = int(parent.stdout.readline())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        deadline = time.time() + 30
        while time.time() < deadline:
            if not pid_alive(server_pid):
                break
            time.sleep(0.25)
        else:
            os.killpg(server_pid, signal.SIGKILL)
            raise AssertionError("orphaned server kept running")
    finally:
        if parent.poll() is None:
            parent.kill()


def test_local_process_backend_starts_a_server_on_the_weights_and_version_and_stops_it(tiny_model_dir, tmp_path):
    """The ServerBackend the fleet and the launcher use (rollout/backend.py), on a real embedded server."""
    from areal_libra.rollout.backend import LocalProcessBackend

    backend = LocalProcessBackend.for_device("cpu")
    assert backend.name == "embedded" and not backend.places_devices
    assert LocalProcessBackend.for_device("cuda").places_devices
    with pytest.raises(ValueError, match="embedded or sglang"):
        LocalProcessBackend("auto")
    (h,) = backend.start(tiny_model_dir, [ServerSpec(tp=1, max_running=8, group="g")], str(tmp_path / "logs"),
                         devices=[("7",)], weight_version=7, timeout=120)
    try:
        assert h.alive() and h.pid == h.proc.pid and h.gpu_ids == ("7",)  # the device pool's bookkeeping
        assert http(h.addr, "/get_weight_version")[1] == {"weight_version": "7"}
        assert http(h.addr, "/get_model_info")[1]["model_path"] == tiny_model_dir
    finally:
        backend.stop(h)
    assert not h.alive()
