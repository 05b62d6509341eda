"""tools/gpu_check.py (issue 26 build 8) on CPU: its comparison with the H200 table, the stand-ins it writes
for packages the bare GPU image lacks, and its --dry-run under tools/bare_env (this venv narrowed to the
image's packages: no AReaL, omegaconf or hydra), checked through the files it writes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tools" / "gpu_check.py"
BARE = REPO / "tools" / "bare_env"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gpu_check = _load()


def _bare_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(BARE), str(REPO)])
    env.pop("BARE_ENV_ALLOW", None)
    return env | extra


def test_compare_layer_ratios_against_the_h200_table():
    ref = json.loads(gpu_check.REFERENCE.read_text())
    same = gpu_check.compare_layer(ref, ref)
    assert len(same) == len(ref["decode_us"]) + len(ref["prefill_ms"]) + len(ref["train_ms"])
    assert {r["ratio"] for r in same} == {1.0}
    assert all(r["timing"] == "graph" for r in same if r["kind"] == "decode")
    # A measured table: decode twice as slow under graphs, one prefill point off the reference's sweep,
    # eager only at one decode point (compared with the reference's eager figure).
    measured = {"decode_us": [{"batch": 16, "ctx": 1024, "graph": 2 * 227.4},
                              {"batch": 64, "ctx": 8192, "eager": 728.1 / 2},
                              {"batch": 3, "ctx": 1024, "graph": 1.0}],
                "prefill_ms": [{"tokens": 4096, "ms": 4.422 * 1.5}, {"tokens": 512, "ms": 0.5}], "train_ms": []}
    rows = gpu_check.compare_layer(measured, ref)
    got = {(r["kind"], r.get("batch"), r.get("ctx"), r.get("tokens")): (r.get("timing"), r["ratio"]) for r in rows}
    assert got == {("decode", 16, 1024, None): ("graph", 2.0), ("decode", 64, 8192, None): ("eager", 0.5),
                   ("prefill", None, None, 4096): (None, 1.5)}


def test_stand_ins_import_and_refuse_use(tmp_path):
    for files in gpu_check.STUBS.values():
        for rel, text in files.items():
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / rel).write_text(text)
    # What AReaL does with them at import time, and what a real use gets.
    code = """
import ray, ray.exceptions
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
import wandb, swanlab, trackio
class Actor: pass
assert ray.remote(Actor) is Actor and ray.remote(num_cpus=1)(Actor) is Actor
assert ray.actor.ActorHandle is ray.actor
assert issubclass(ray.exceptions.GetTimeoutError, Exception) and not ray.is_initialized()
assert wandb.init(mode="disabled") is None and swanlab.log({}) is None and trackio.finish() is None
for call in (lambda: ray.init(), lambda: PlacementGroup(), lambda: ray.get(1)):
    try:
        call()
    except RuntimeError as e:
        assert "not installed" in str(e)
    else:
        raise SystemExit("a stand-in did not refuse")
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=str(tmp_path)), cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_bare_env_hides_what_the_image_lacks():
    code = ("import importlib.util as u, importlib.metadata as m, yaml, torch\n"
            "print(u.find_spec('omegaconf') is None, u.find_spec('areal') is None, u.find_spec('hydra') is None,"
            " u.find_spec('transformers') is not None)\n"
            "try:\n    m.version('omegaconf')\nexcept m.PackageNotFoundError:\n    print('no metadata')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_bare_env())
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split("\n")[:2] == ["True True True True", "no metadata"]


@pytest.mark.parametrize("args", [["--parts", "a,x"], ["--train-steps", "-1"], ["--make-bundle", "/no/such.txt"]])
def test_bad_input_is_one_line_and_exit_2(args, tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), *args], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "error:" in r.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_dry_run_writes_every_part_in_the_bare_environment(tmp_path):
    """Every part's plumbing on CPU with only the image's packages: the profiler and the bench run, part c
    says why it is skipped (no bundle here), and each part's JSON and the summary are written."""
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), "--bundle",
                        str(tmp_path / "no_bundle")], capture_output=True, text=True, timeout=600, env=_bare_env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    a = json.loads((out / "a_profile.json").read_text())
    assert a["status"] == "ok" and a["device"] == "cpu" and a["gpu"] == "cpu"
    table = a["measured_table"]
    assert table["layer"]["hidden"] == 128 and len(table["decode_us"]) >= 2 and table["train_ms"][0]["ms"] > 0
    assert a["compared_points"] == len(a["ratios"]) == 0  # the CPU sweep shares no point with the H200 table
    assert isinstance(a["fit_within_tolerance"], bool)
    b = json.loads((out / "b_elastic.json").read_text())
    assert b["status"] == "ok" and b["figures"]["equivalence_max_abs_diff"] == 0.0
    assert b["figures"]["join_latency_s"] > 0 and b["during_over_no_join"] > 0
    assert b["torch"]["cuda_available"] is False
    c = json.loads((out / "c_trainer.json").read_text())
    assert c["status"] == "skipped" and "no wheel bundle" in c["note"]
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["parts"]) == ["a_profile", "b_elastic", "c_trainer"]
    assert summary["elapsed_s"] < gpu_check.DEFAULT_BUDGET_S
    log = (out / "gpu_check.log").read_text()
    assert "areal_libra.cost.profile" in log and "evaluation.elastic_bench" in log


@pytest.mark.slow
@pytest.mark.skipif(not (gpu_check.BUNDLE / "wheels").is_dir(), reason="no .gpu_bundle here (make gpu-bundle)")
def test_part_c_installs_patches_and_imports_the_trainer_from_the_bundle(tmp_path):
    """Part c up to the training run, from the bundle, in the bare environment (the bundle's compiled wheels
    are for Python 3.12, multiprocess's pure one too: their packages come from this venv)."""
    out = tmp_path / "out"
    env = _bare_env(BARE_ENV_ALLOW="pydantic_core,rpds,orjson,jiter,zstandard,pybase64,multiprocess")
    r = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--parts", "c", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, env=env)
    c = json.loads((out / "c_trainer.json").read_text())
    assert r.returncode == 0 and c["status"] == "ok", json.dumps(c)[-3000:]
    assert c["bundle_mib"] <= 64 and c["stages"]["patches"]["rc"] == 0
    assert set(c["stages"]["stand_ins"]) == {"ray", "wandb", "swanlab", "trackio"}
    assert c["stages"]["imports"]["stdout"].startswith("1.0.4 ")


def test_a_command_past_its_time_box_is_stopped(tmp_path):
    chk = gpu_check.Check(tmp_path / "out", budget_s=60, device="cpu")
    # SIGINT first when there is a grace period: a program that cleans up on it ends on its own ...
    polite = "import time\ntry:\n    time.sleep(30)\nexcept KeyboardInterrupt:\n    print('cleaned up')\n    raise SystemExit(130)"
    res = chk.run([sys.executable, "-c", polite], timeout=2, grace=10)
    assert res["timed_out"] and res["rc"] == 130 and "cleaned up" in res["stdout"] and res["wall_s"] < 10
    # ... one that ignores it is killed when the grace period ends.
    stubborn = "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nprint('up', flush=True)\ntime.sleep(30)"
    res = chk.run([sys.executable, "-c", stubborn], timeout=2, grace=1)
    assert res["timed_out"] and res["rc"] == -9 and res["stdout"].strip() == "up" and res["wall_s"] < 10
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    assert log.count("timed out]") == 2
