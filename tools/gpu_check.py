#!/usr/bin/env python3
"""GPU check (issue 26, build 8): what can run on one bare GPU machine, in at most 4 minutes.

    python3 tools/gpu_check.py [--out DIR] [--device cuda|cpu] [--dry-run] [--parts a,b,c] [--train-steps N]
                               [--budget-s S] [--bundle DIR]

Written for a GPU machine without network: Python 3.12, torch with CUDA and transformers, but no SGLang,
AReaL or omegaconf and no package index. Parts a and b need nothing beyond that image (the repository's own
code runs from the working tree; its C++ extensions are optional, the Python fallbacks give the same
results); part c installs the wheel bundle that `make gpu-bundle` puts under .gpu_bundle/ (at most 64 MiB).

  a  the layer profiler at the real shape (python -m areal_libra.cost.profile --device cuda, Qwen3-14B's
     layer) against the table measured on an H200 (tests/data/h200_measured.json): measured / reference per
     point, and whether the profiler's own fit is within its tolerances;
  b  the elastic bench (evaluation/elastic_bench.py) on a machine where CUDA is present: the CPU/gloo bed
     must neither touch nor be broken by CUDA;
  c  (last, optional) AReaL's trainer in bf16 on the GPU for a few steps on the tiny model
     (python -m areal_libra.launch experiment=dapo_math cluster=cpu actor.dtype=bfloat16: the embedded
     servers on the CPUs, AReaL picks the CUDA platform for the trainer).

Every part is its own process group with a timeout, and its JSON (a_profile.json, b_elastic.json,
c_trainer.json) is written as soon as it ends; summary.json after each part; gpu_check.log has every
command's output. --out defaults to $OUT (the device tool's folder), else ./gpu_check_out.

--dry-run (= --device cpu) runs every part's plumbing here in about a minute: the profiler at a small
shape, the bench on a small MLP, part c up to its import check (the launch only with --train-steps N).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "tests" / "data" / "h200_measured.json"
BUNDLE = REPO / ".gpu_bundle"
BUNDLE_LIMIT = 64 * 2**20  # what the device tool carries besides the tracked tree
DEFAULT_BUDGET_S = 235.0  # the whole script; the limit is 4 minutes
# Per part, at most (cuda, cpu) seconds; a part never gets more than what is left of the budget.
CAPS = {"a": (100.0, 90.0), "b": (75.0, 120.0), "c": (200.0, 900.0)}
MIN_PART_S = 20.0  # below this a part is skipped as out of time
LAUNCH_GRACE_S = 15.0  # a launch stopped at its time box: time to stop its servers and trainer
TAIL = 4000  # characters of a command's output kept in its JSON

sys.path.insert(0, str(REPO))
from areal_libra.utils import atomic_write_text  # noqa: E402 - the repository is put on the path first

# Packages AReaL imports at module level on the trainer's path whose wheels do not fit the bundle (ray alone
# is over 64 MiB; wandb 20 MiB; swanlab pulls boto3/botocore, trackio gradio): where one is missing, part c
# writes a stand-in. The local SPMD trainer never calls ray; the loggers are asked for nothing but
# init/log/finish (stats_logger.wandb.mode=disabled), and those do nothing here (the run's own
# metrics.jsonl is what the check reads). Any other use of the ray stand-in raises.
STUB_RAY = {
    "ray/__init__.py": '''"""Stand-in written by tools/gpu_check.py: ray is not installed on this machine."""


class _AbsentType(type):
    def __getattr__(cls, name):  # ray.actor.ActorHandle in an annotation: the placeholder again
        if name.startswith("__"):
            raise AttributeError(name)
        return cls


class _Absent(metaclass=_AbsentType):
    def __init__(self, *args, **kwargs):
        raise RuntimeError("ray is not installed on this machine (tools/gpu_check.py stand-in)")


def remote(*args, **kwargs):
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return lambda f: f


def is_initialized():
    return False


def init(*args, **kwargs):
    raise RuntimeError("ray is not installed on this machine (tools/gpu_check.py stand-in)")


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Absent
''',
    "ray/exceptions.py": '''class RayError(Exception):
    pass


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return type(name, (RayError,), {})
''',
    "ray/util/__init__.py": "from ray import __getattr__  # noqa: F401\n",
    "ray/runtime_env.py": "from ray import __getattr__  # noqa: F401\n",
    "ray/util/placement_group.py": "from ray import __getattr__  # noqa: F401\n",
    "ray/util/scheduling_strategies.py": "from ray import __getattr__  # noqa: F401\n",
}
STUB_LOGGER = '''"""Stand-in written by tools/gpu_check.py: this experiment logger is not installed on this machine;
init/log/finish/login do nothing (stats_logger.wandb.mode=disabled)."""


def _nothing(*args, **kwargs):
    return None


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _nothing
'''
STUBS = {"ray": STUB_RAY, "wandb": {"wandb/__init__.py": STUB_LOGGER},
         "swanlab": {"swanlab/__init__.py": STUB_LOGGER}, "trackio": {"trackio/__init__.py": STUB_LOGGER}}


class Check:
    """The output folder, the budget, and one runner for every command (own process group, timeout)."""

    def __init__(self, out: Path, budget_s: float, device: str) -> None:
        self.out, self.device = out, device
        self.t0 = time.monotonic()
        self.deadline = self.t0 + budget_s
        self.parts: dict[str, dict] = {}
        self.work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
        out.mkdir(parents=True, exist_ok=True)
        self.log_path = out / "gpu_check.log"
        self.log_path.write_text("")

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, text: str) -> None:
        print(text, flush=True)
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write(text + "\n")

    def run(self, argv: list[str], timeout: float, env: dict[str, str] | None = None,
            cwd: Path = REPO, grace: float = 0.0) -> dict:
        """Run argv; at `timeout` its process group gets SIGINT, and SIGKILL `grace` seconds later (the launch
        stops its servers and trainer, which run in sessions of their own, on SIGINT). Returns rc, wall_s,
        timed_out, stdout, output."""
        shown = [a.splitlines()[0] + " ..." if "\n" in a else a for a in argv]  # a -c program: its first line
        self.log(f"$ {' '.join(shown)}  (timeout {timeout:.0f} s)")
        t = time.monotonic()
        with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as err:
            proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=err, text=True,
                                    start_new_session=True, preexec_fn=_default_sigint)
            try:
                stdout, _ = proc.communicate(timeout=max(1.0, timeout))
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out, stdout = True, None
                if grace > 0:
                    _signal_group(proc.pid, signal.SIGINT)
                    try:
                        stdout, _ = proc.communicate(timeout=grace)
                    except subprocess.TimeoutExpired:
                        pass
                if stdout is None:
                    _signal_group(proc.pid, signal.SIGKILL)
                    stdout, _ = proc.communicate()
            err.seek(0)
            stderr = err.read()
        _signal_group(proc.pid, signal.SIGKILL)  # what a command left behind (bed processes) never outlives it
        res = {"rc": proc.returncode, "wall_s": round(time.monotonic() - t, 2), "timed_out": timed_out,
               "stdout": stdout or "", "output": (stdout or "") + (stderr or "")}
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write(res["output"] + f"\n[rc {res['rc']}, {res['wall_s']} s{', timed out' if timed_out else ''}]\n")
        return res

    def env(self, extra_path: tuple[str, ...] = ()) -> dict[str, str]:
        env = dict(os.environ)
        path = [*extra_path, str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env.update(PYTHONPATH=os.pathsep.join(path), PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        return env

    def record(self, name: str, result: dict) -> None:
        """Write the part's JSON now (a later part's crash or timeout does not lose it) and the summary."""
        result = {"part": name, "device": self.device} | result
        self.parts[name] = result
        atomic_write_text(self.out / f"{name}.json", json.dumps(result, indent=1, default=str) + "\n")
        summary = {"device": self.device, "elapsed_s": round(time.monotonic() - self.t0, 1),
                   "parts": {k: {"status": v["status"], "wall_s": v.get("wall_s"), "note": v.get("note", "")}
                             for k, v in self.parts.items()}}
        atomic_write_text(self.out / "summary.json", json.dumps(summary, indent=1) + "\n")
        self.log(f"== {name}: {result['status']}{' - ' + result['note'] if result.get('note') else ''}")

    def budget(self, part: str) -> float | None:
        cap = CAPS[part][0 if self.device == "cuda" else 1]
        left = self.left()
        return min(cap, left) if left >= MIN_PART_S else None


def _default_sigint() -> None:
    """In the child before exec: SIGINT back to its default. An ignored SIGINT is inherited through exec (a
    command started from a background shell, or from a process that ignores it), and Python then installs no
    KeyboardInterrupt handler, so the time box's SIGINT would never let the launch clean up."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(text: str) -> str:
    return text[-TAIL:]


def _last_json(text: str):
    """The last line of a command's stdout that parses as JSON (None if none does)."""
    for line in reversed(text.splitlines()):
        if line.startswith(("{", "[")):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def _status(res: dict, ok: bool) -> str:
    return "timeout" if res["timed_out"] else ("ok" if ok else "failed")


def compare_layer(measured: dict, reference: dict) -> list[dict]:
    """measured / reference per point present in both tables (decode by batch and ctx, the CUDA-graph
    figure where both have one, else eager; prefill and train by tokens)."""
    rows: list[dict] = []
    ref_decode = {(r["batch"], r["ctx"]): r for r in reference.get("decode_us", [])}
    for r in measured.get("decode_us", []):
        ref = ref_decode.get((r["batch"], r["ctx"]))
        key = next((k for k in ("graph", "eager") if ref is not None and k in r and k in ref), None)
        if key is not None:
            rows.append({"kind": "decode", "batch": r["batch"], "ctx": r["ctx"], "timing": key, "unit": "us",
                         "measured": r[key], "reference": ref[key], "ratio": round(r[key] / ref[key], 4)})
    for kind, field, unit in (("prefill", "prefill_ms", "ms"), ("train", "train_ms", "ms")):
        ref_by = {r["tokens"]: r["ms"] for r in reference.get(field, [])}
        for r in measured.get(field, []):
            if r["tokens"] in ref_by:
                rows.append({"kind": kind, "tokens": r["tokens"], "unit": unit, "measured": r["ms"],
                             "reference": ref_by[r["tokens"]], "ratio": round(r["ms"] / ref_by[r["tokens"]], 4)})
    return rows


def part_a(chk: Check) -> None:
    """The layer profiler at the real shape (cuda) or a small one (cpu), compared with the H200 table."""
    timeout = chk.budget("a")
    if timeout is None:
        return chk.record("a_profile", {"status": "skipped", "note": "out of time"})
    table_path = chk.work / "layer_table.json"
    argv = [sys.executable, "-m", "areal_libra.cost.profile", "--json", "--save-table", str(table_path)]
    argv += ["--device", "cuda"] if chk.device == "cuda" else ["--layer", "--quick", "--shape", "128,4,2,32,512"]
    res = chk.run(argv, timeout, chk.env())
    table = json.loads(table_path.read_text()) if table_path.exists() else None
    fit = _last_json(res["stdout"])
    reference = json.loads(REFERENCE.read_text())
    rows = compare_layer(table, reference) if table else []
    ratios = [r["ratio"] for r in rows]
    # rc 2 with a table: measured, but the profiler refused its own fit (outside its tolerances)
    result = {"status": _status(res, table is not None), "wall_s": res["wall_s"], "rc": res["rc"],
              "command": " ".join(argv[1:]), "gpu": (table or {}).get("gpu"), "shape": (table or {}).get("layer"),
              "fit_within_tolerance": bool(fit) and "refused" not in fit and res["rc"] == 0,
              "fit_refused": (fit or {}).get("refused"), "fit_max_rel_error": (fit or {}).get("max_rel_error"),
              "compared_points": len(rows), "ratio_min": min(ratios, default=None),
              "ratio_max": max(ratios, default=None), "ratios": rows, "measured_table": table,
              "reference": str(REFERENCE.relative_to(REPO))}
    if table is not None and not rows:
        result["note"] = "no point of this sweep is in the H200 table (a different shape or sweep)"
    elif rows:
        result["note"] = f"{len(rows)} points, measured/reference {min(ratios):.2f}..{max(ratios):.2f}"
    if res["rc"] not in (0, 2) or table is None:
        result["log_tail"] = _tail(res["output"])
    chk.record("a_profile", result)


def part_b(chk: Check) -> None:
    """The elastic bench with CUDA present (the bed itself is CPU/gloo: it must not trip over CUDA)."""
    timeout = chk.budget("b")
    if timeout is None:
        return chk.record("b_elastic", {"status": "skipped", "note": "out of time"})
    argv = [sys.executable, "-m", "evaluation.elastic_bench", "--json"]
    argv += (["--hidden", "256", "--batch", "128", "--repeats", "2"] if chk.device == "cuda"
             else ["--model", "mlp", "--hidden", "256", "--batch", "64", "--repeats", "1", "--max-steps", "2000"])
    probe = chk.run([sys.executable, "-c", "import json, torch; print(json.dumps({'torch': torch.__version__, "
                     "'cuda_available': torch.cuda.is_available(), 'device_count': torch.cuda.device_count()}))"],
                    30.0, chk.env())
    cuda = _last_json(probe["stdout"]) if probe["rc"] == 0 else None
    res = chk.run(argv, timeout, chk.env())
    figures = _last_json(res["stdout"])
    result = {"status": _status(res, res["rc"] == 0 and figures is not None), "wall_s": res["wall_s"],
              "rc": res["rc"], "command": " ".join(argv[1:]), "torch": cuda, "figures": figures}
    if figures:
        ratio = figures["core_step_s_during_join"] / figures["core_step_s_no_join"]
        result["during_over_no_join"] = round(ratio, 3)
        result["note"] = (f"join {figures['join_latency_s']:.2f} s, release {figures['release_latency_s']:.3f} s, "
                          f"step during/no join {ratio:.2f}, equivalence {figures['equivalence_max_abs_diff']:g}")
    else:
        result["log_tail"] = _tail(res["output"])
    if chk.device == "cuda" and not (cuda or {}).get("cuda_available"):
        result["note"] = "CUDA not available to torch: this is not the check the part is for"
    chk.record("b_elastic", result)


def bundle_wheels(bundle: Path) -> tuple[list[Path], int]:
    """The bundle's wheels and its size in bytes (wheels and the model cache: what the device tool carries)."""
    wheels = sorted((bundle / "wheels").glob("*.whl"))
    size = sum(f.stat().st_size for f in bundle.rglob("*") if f.is_file()) if bundle.is_dir() else 0
    return wheels, size


def installable(wheels: list[Path]) -> tuple[list[Path], list[str]]:
    """The wheels this interpreter can install, and the names of the others (a Python 3.12 bundle's compiled
    wheels on another Python: in the simulation here their packages come from tools/bare_env's allow list)."""
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename

    ours = set(sys_tags())
    ok, other = [], []
    for w in wheels:
        (ok if parse_wheel_filename(w.name)[3] & ours else other).append(w)
    return ok, [w.name for w in other]


def make_bundle(bundle: Path, requirements: Path) -> int:
    """`make gpu-bundle`: Python 3.12 x86-64 wheels of `requirements` (--no-deps) into bundle/wheels and the tiny
    model of experiments/model/tiny_qwen2.yaml into bundle/cache/models; refused when over 64 MiB."""
    import shutil

    import yaml

    from areal_libra.models.tiny import TinyModelConfig, ensure_model

    tmp = bundle / "wheels.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    argv = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
            "3.12", "--implementation", "cp", "-d", str(tmp), "-r", str(requirements)]
    for plat in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                 "manylinux1_x86_64"):
        argv += ["--platform", plat]
    if subprocess.run(argv).returncode != 0:
        print(f"error: pip could not download {requirements} for Python 3.12", file=sys.stderr)
        return 2
    shutil.rmtree(bundle / "wheels", ignore_errors=True)
    tmp.rename(bundle / "wheels")
    # The model part c's launch resolves (actor.path=auto): dapo_math's task with tiny_qwen2.yaml's seed.
    seed = int(yaml.safe_load((REPO / "experiments/model/tiny_qwen2.yaml").read_text())["libra"]["model"]["seed"])
    src = ensure_model(seed=seed, config=TinyModelConfig.for_task("math"))
    dst = bundle / "cache" / "models" / src.name
    shutil.rmtree(bundle / "cache", ignore_errors=True)
    shutil.copytree(src, dst)
    wheels, size = bundle_wheels(bundle)
    print(f"{bundle}: {len(wheels)} wheels + model {src.name}, {size / 2**20:.1f} MiB")
    if size > BUNDLE_LIMIT:
        print(f"error: the bundle is {size / 2**20:.1f} MiB, over the 64 MiB the device tool carries", file=sys.stderr)
        return 2
    return 0


def part_c(chk: Check, bundle: Path, steps: int) -> None:
    """AReaL's trainer in bf16 on the GPU for a few steps on the tiny model, from the wheel bundle."""
    t = time.monotonic()
    wheels, size = bundle_wheels(bundle)
    model_root = bundle / "cache"
    base = {"bundle": str(bundle), "wheels": len(wheels), "bundle_mib": round(size / 2**20, 1)}
    if not wheels:
        return chk.record("c_trainer", base | {"status": "skipped", "note": f"no wheel bundle in {bundle}/wheels "
                                                "(make gpu-bundle, then carry .gpu_bundle)"})
    if size > BUNDLE_LIMIT:
        return chk.record("c_trainer", base | {"status": "skipped", "note": f"bundle {size / 2**20:.1f} MiB is over "
                                                "the 64 MiB the device tool carries"})
    timeout = chk.budget("c")
    if timeout is None:
        return chk.record("c_trainer", base | {"status": "skipped", "note": "out of time"})
    site = chk.work / "site"
    stages: dict[str, dict] = {}

    def remaining() -> float:  # every stage draws on the part's one deadline (and the script's)
        return max(1.0, min(t + timeout - time.monotonic(), chk.left() - 2.0))

    def done(status: str, note: str, **more) -> None:
        chk.record("c_trainer", base | {"status": status, "note": note, "wall_s": round(time.monotonic() - t, 2),
                                        "stages": stages} | more)

    wheels, foreign = installable(wheels)
    res = chk.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                   "--no-cache-dir", "--disable-pip-version-check", "--target", str(site), *map(str, wheels)],
                  remaining(), chk.env())
    stages["install"] = {"rc": res["rc"], "wall_s": res["wall_s"], "installed": len(wheels),
                         "not_for_this_python": foreign}
    if res["rc"] != 0:
        return done(_status(res, False), "pip could not install the bundle", log_tail=_tail(res["output"]))
    env = chk.env((str(site),))
    probe = ("import importlib, json, sys\nmissing = []\nfor name in sys.argv[1:]:\n    try:\n"
             "        importlib.import_module(name)\n    except ImportError:\n        missing.append(name)\n"
             "print(json.dumps(missing))\n")
    res = chk.run([sys.executable, "-c", probe, *sorted(STUBS)], remaining(), env)
    missing = _last_json(res["stdout"]) if res["rc"] == 0 else None
    missing = sorted(STUBS) if missing is None else missing
    for name in missing:
        for rel, text in STUBS[name].items():
            atomic_write_text(site / rel, text)
    stages["stand_ins"] = missing
    res = chk.run([sys.executable, "-m", "areal_libra.patches", "apply", "--areal-dir", str(site / "areal")],
                  remaining(), env)
    stages["patches"] = {"rc": res["rc"], "wall_s": res["wall_s"]}
    if res["rc"] != 0:
        return done(_status(res, False), "the AReaL patches did not apply", log_tail=_tail(res["output"]))
    if steps <= 0:  # the dry run: the trainer's imports stand in for the run (a run shows an import error too)
        res = chk.run([sys.executable, "-c", "from areal import PPOTrainer\nfrom areal.api.cli_args import "
                       "GRPOConfig\nimport areal_libra.live.train, areal_libra.launch, areal_libra.server.embedded_server"
                       "\nimport areal, torch\nprint(areal.__version__, torch.__version__, torch.cuda.is_available())"],
                      remaining(), env)
        stages["imports"] = {"rc": res["rc"], "wall_s": res["wall_s"], "stdout": res["stdout"].strip()[-200:]}
        if res["rc"] != 0:
            return done(_status(res, False), "the trainer's imports failed", log_tail=_tail(res["output"]))
        return done("ok", "bundle installed, patched and imported; no training steps asked (--train-steps)")
    left = remaining() - LAUNCH_GRACE_S
    if left < MIN_PART_S:
        return done("skipped", "out of time before the training run")
    runs = chk.work / "runs"
    argv = [sys.executable, "-m", "areal_libra.launch", "experiment=dapo_math", "cluster=cpu",
            f"total_train_steps={steps}", f"cluster.fileroot={runs}", "trial_name=gpucheck",
            "stats_logger.wandb.mode=disabled"]
    if chk.device == "cuda":
        argv.append("actor.dtype=bfloat16")
    env = env | {"AREAL_LIBRA_CACHE": str(model_root)} if (model_root / "models").is_dir() else env
    res = chk.run(argv, left, env, grace=LAUNCH_GRACE_S)
    metrics = next(runs.rglob("metrics.jsonl"), None) if runs.exists() else None
    recs = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics else []
    trainer_log = next(runs.rglob("trainer.log"), None) if runs.exists() else None
    log_text = trainer_log.read_text(errors="replace") if trainer_log else ""
    platform = next((line.split("INFO:", 1)[1].strip(" \x1b[0m") for line in log_text.splitlines()
                     if "PlatformInit" in line and "INFO:" in line), None)
    mem = [float(m) for m in _allocated_gb(log_text)]
    stages["train"] = {"rc": res["rc"], "wall_s": res["wall_s"], "timed_out": res["timed_out"]}
    ok = res["rc"] == 0 and len(recs) == steps
    done(_status(res, ok), f"{len(recs)}/{steps} steps; trainer platform: {platform}", command=" ".join(argv[1:]),
         steps=[{k: r.get(k) for k in ("step", "reward", "throughput_tokens_per_s", "gen_tokens")} for r in recs],
         trainer_platform=platform, trainer_max_allocated_gb=max(mem, default=None),
         **({} if ok else {"log_tail": _tail(res["output"]), "trainer_log_tail": _tail(log_text)}))


def _allocated_gb(text: str) -> list[str]:
    key = "memory allocated (GB): "
    return [line.split(key, 1)[1].split(",", 1)[0] for line in text.splitlines() if key in line]


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tools/gpu_check.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out", help="output folder (default $OUT)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--dry-run", action="store_true", help="--device cpu: every part's plumbing, small and quick")
    ap.add_argument("--parts", default="a,b,c", help="comma-separated subset of a,b,c")
    ap.add_argument("--train-steps", type=int, default=None, help="part c's training steps (default 3 on cuda, "
                    "0 on cpu: install, patch and import only)")
    ap.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="the whole script's time limit")
    ap.add_argument("--bundle", default=str(BUNDLE), help="the folder `make gpu-bundle` wrote (wheels/, cache/)")
    ap.add_argument("--make-bundle", metavar="REQUIREMENTS", default=None,
                    help="build the bundle here from this requirements file instead of checking (make gpu-bundle)")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.device = "cpu"
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not parts or set(parts) - {"a", "b", "c"}:
        ap.error(f"--parts {args.parts!r}: a comma-separated subset of a,b,c")
    args.parts = parts
    if args.train_steps is None:
        args.train_steps = 3 if args.device == "cuda" else 0
    if args.train_steps < 0 or args.budget_s <= 0:
        ap.error("--train-steps must be >= 0 and --budget-s > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.make_bundle:
        if not Path(args.make_bundle).is_file():
            print(f"error: --make-bundle {args.make_bundle}: no such file", file=sys.stderr)
            return 2
        return make_bundle(Path(args.bundle), Path(args.make_bundle))
    chk = Check(Path(args.out), args.budget_s, args.device)
    chk.log(f"gpu_check: device {args.device}, parts {','.join(args.parts)}, budget {args.budget_s:.0f} s, "
            f"python {sys.version.split()[0]}, out {args.out}")
    try:
        for part in args.parts:
            if part == "a":
                part_a(chk)
            elif part == "b":
                part_b(chk)
            else:
                part_c(chk, Path(args.bundle), args.train_steps)
    finally:
        shutil.rmtree(chk.work, ignore_errors=True)
    failed = [k for k, v in chk.parts.items() if v["status"] in ("failed", "timeout")]
    chk.log(f"gpu_check: done in {time.monotonic() - chk.t0:.0f} s; " + (f"failed: {', '.join(failed)}" if failed
                                                                         else "no part failed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
