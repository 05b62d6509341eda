"""Libra on Ray (areal_libra/ray/): the RayBackend on a real Ray node, and the launch's bad input (no cluster,
too few accelerators, a node without the project): one line, exit 2, nothing left running."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _ray_pids() -> dict[int, bytes]:
    """Live processes of local Ray clusters started by areal_libra (their private temp folders)."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes()
            except OSError:
                continue
            if b"/tmp/arl-ray-" in cmd:
                out[int(d.name)] = cmd
    return out


def _launch(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "areal_libra.launch", "experiment=dapo_math", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _error_line(r: subprocess.CompletedProcess) -> str:
    lines = [x for x in r.stderr.splitlines() if x.startswith("areal_libra: error:")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    return lines[0]


def test_no_ray_cluster_at_the_address_is_one_line() -> None:
    from areal_libra.utils import free_port

    r = _launch("cluster=ray", f"libra.ray.address=127.0.0.1:{free_port()}", "total_train_steps=1")
    assert r.returncode == 2
    assert "no Ray cluster answers there" in _error_line(r)


def test_too_few_accelerators_for_the_plan_leaves_nothing_behind() -> None:
    before = set(_ray_pids())
    # 2 nodes x 1 accel = 2; the plan wants 2 trainer ranks + 2 servers
    r = _launch("cluster=ray_local", "libra.ray.local_accel=1", "libra.ray.timeout_s=400", "total_train_steps=1")
    assert r.returncode == 2
    assert "the plan needs 4 accel" in _error_line(r)
    left = {p: c for p, c in _ray_pids().items() if p not in before}
    assert not left, left


def test_node_without_the_project_is_named(tmp_path) -> None:
    """A node whose Python cannot import the project (here: a broken areal_libra first on its path) is named
    in one line before anything is placed. The driver runs from another folder: Ray puts the driver's working
    directory on its workers' path, which would hide the broken copy."""
    fake = Path("/tmp") / f"arl-noproj-{os.getpid()}"
    (fake / "areal_libra").mkdir(parents=True, exist_ok=True)
    (fake / "areal_libra" / "__init__.py").write_text("raise ImportError('areal_libra is not installed here')\n")
    script = f"""
import ray
from areal_libra.ray.cluster import LocalRayCluster, RayClusterError
from areal_libra.ray.run import check_nodes
cluster = LocalRayCluster(nodes=2, cpus=1, accel=1, log_dir={str(tmp_path)!r}, start_timeout_s=400,
                          node_env={{1: {{"PYTHONPATH": {str(fake)!r}}}}}).start()
try:
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    try:
        check_nodes(timeout_s=120)
        print("NO ERROR")
    except RayClusterError as e:
        print("ERROR:", e)
finally:
    ray.shutdown()
    print("STOPPED", len(cluster.stop()))
"""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=900)
    lines = [x for x in r.stdout.splitlines() if x.startswith(("ERROR:", "NO ERROR", "STOPPED"))]
    assert lines and lines[0].startswith("ERROR:") and "install areal_libra on every node" in lines[0], r.stdout
    assert lines[-1].startswith("STOPPED")


def test_ray_backend_places_a_server_on_a_node_ip_and_removes_its_group(tiny_model_dir) -> None:
    import ray
    from ray.util import placement_group_table

    from areal_libra.ray.backend import RayBackend, pick_node
    from areal_libra.ray.cluster import init_private
    from areal_libra.rollout.launcher import ServerSpec, is_healthy

    init_private(num_cpus=2, resources={"accel": 2}, namespace="t-ray-backend")
    try:
        backend = RayBackend("embedded", "t-ray-backend", place_timeout_s=60)
        [s] = backend.start(str(tiny_model_dir), [ServerSpec(tp=1, group="g0")], str(Path("/tmp") / "t-ray-logs"))
        assert is_healthy(s.addr) and s.alive() and s.node_id == ray.get_runtime_context().get_node_id()
        assert s.addr.rpartition(":")[0] == ray.util.get_node_ip_address()
        assert pick_node(2) is None and pick_node(1) is not None  # one of two accel taken
        backend.stop(s)
        assert not s.alive() and not is_healthy(s.addr)
        states = {v["name"]: v["state"] for v in placement_group_table().values()}
        assert states[s.name] == "REMOVED"
        deadline = time.monotonic() + 60  # Ray reports freed resources asynchronously
        while pick_node(2) is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert pick_node(2) is not None
    finally:
        ray.shutdown()
