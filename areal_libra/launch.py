"""Launch an experiment: python -m areal_libra.launch experiment=NAME [cluster=NAME] [key=value ...] [--dry-run]

With --dry-run: prints as JSON what it would start (every server's and the trainer's command line and the
environment the launcher adds, the plan that sized them, the checks only a GPU can make), starts nothing,
writes nothing, needs no GPU (docs/gpu.md).

Composes the hydra config (AReaL key names), prepares model and data, starts the rollout servers
(embedded SGLang-API servers on CPU, SGLang on GPU), runs AReaL's GRPO trainer in SPMD mode in a child
process, shows progress, and leaves metrics.jsonl, the W&B run and all logs in the run's log directory.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from areal_libra.config import Composed, ConfigError, compose, lag_bounded, libra_config, save
from areal_libra.rollout.sglang_args import SGLangArgsError, SGLangUnavailable, parse_command_lines

# libra mode: how long every rollout server may be dead while the trainer starts replacements
# (rollout/revive.py) before the launcher gives up.
REVIVE_GRACE_S = 180.0


class LaunchError(RuntimeError):
    """A launch problem the user can fix; printed as one line."""


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - a broken torch means no CUDA here
        return False


def resolve_model(c: Composed) -> str:
    path = str(c.areal.actor.path)
    if path in ("auto", "", "???"):
        from areal_libra.models.tiny import TinyModelConfig, ensure_model

        model = c.libra.model
        try:
            config = TinyModelConfig.for_task(str(model.task))
        except ValueError as e:
            raise LaunchError(f"libra.model.task: {e}") from None
        return str(ensure_model(seed=int(model.seed), config=config))
    p = Path(path)
    if not p.is_dir() and _HF_ID.match(path) and not p.exists():
        p = _hf_snapshot(path)  # a Hugging Face id (Qwen/Qwen3-8B): its local copy in the HF cache
    if not p.is_dir():
        raise LaunchError(f"actor.path={path}: no such model directory")
    try:
        from transformers import AutoConfig

        AutoConfig.from_pretrained(str(p))
    except Exception as e:  # noqa: BLE001 - any failure means "not a model"
        raise LaunchError(f"actor.path={path} is not a Hugging Face model ({type(e).__name__})") from None
    return str(p)


_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _hf_snapshot(repo_id: str) -> Path:
    """The local directory of a Hugging Face model id (downloaded into the HF cache when not there yet:
    config, tokenizer and safetensors weights); one line when it cannot be had."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model",
                                                               "*.tiktoken", "*.py"]))
    except Exception as e:  # noqa: BLE001 - offline, no such repo, no access: all the same to the user
        raise LaunchError(f"actor.path={repo_id}: not a local directory, and the Hugging Face model could not be "
                          f"fetched ({type(e).__name__}); download it and pass actor.path=/its/directory") from None


def check_sglang(c: Composed) -> None:
    """A cuda run starts `python -m sglang.launch_server`: say what to install instead of failing in a child
    process (the CPU test environment's --no-deps sglang has no sgl_kernel, so it does not count)."""
    import importlib.util

    if c.libra.device != "cuda":
        return
    if importlib.util.find_spec("sglang") is None or importlib.util.find_spec("sgl_kernel") is None:
        raise LaunchError("cluster=gpu starts SGLang servers, which this environment lacks: run `make setup-gpu` "
                          "(requirements/gpu.txt), then `make run`; or `make run ARGS=cluster=cpu` for the CPU cluster")


def check_dataset(c: Composed) -> None:
    """Before anything starts: the dataset file (its builder module's `check_file`: exists, readable, the
    public schema's columns) and a local retriever's corpus (exists, first record in Search-R1's format)."""
    corpus = c.libra.tools.corpus
    if corpus is not None:
        check_corpus(str(corpus))
    path = c.areal.train_dataset.path
    if path in (None, "", "generated"):
        return
    if not Path(str(path)).exists():
        raise LaunchError(f"train_dataset.path={path}: no such file or directory")
    import importlib

    module = str(c.libra.dataset.builder).rpartition(".")[0]
    try:
        check = getattr(importlib.import_module(module), "check_file", None)
    except ImportError as e:
        raise LaunchError(f"libra.dataset.builder={c.libra.dataset.builder}: cannot import ({e})") from None
    if check is None:
        return
    try:
        check(str(path))
    except ValueError as e:  # DatasetError
        raise LaunchError(f"train_dataset.path: {e}") from None


def check_corpus(path: str) -> None:
    """`libra.tools.corpus`: a JSONL file whose first record has a string 'contents' (the server checks
    every line when it indexes them)."""
    p = Path(path)
    if not p.is_file():
        raise LaunchError(f"libra.tools.corpus={path}: no such file")
    try:
        with open(p, encoding="utf-8") as f:
            first = next((line for line in f if line.strip()), None)
    except (OSError, UnicodeDecodeError) as e:
        raise LaunchError(f"libra.tools.corpus={path}: cannot read ({e})") from None
    if first is None:
        raise LaunchError(f"libra.tools.corpus={path}: the corpus is empty")
    try:
        rec = json.loads(first)
    except json.JSONDecodeError:
        raise LaunchError(f"libra.tools.corpus={path}: not JSONL of {{\"id\", \"contents\"}} records") from None
    if not isinstance(rec, dict) or not isinstance(rec.get("contents"), str):
        raise LaunchError(f"libra.tools.corpus={path}: a record needs a string 'contents' (Search-R1's format)")


def resolve_control_cluster(c: Composed) -> str:
    """`libra.control.cluster=auto`: the planner's preset from this machine's GPUs (model and count; the cpu
    preset on the embedded CPU cluster), written into the config the trainer reads (the trainer sees only
    its own GPU). An unknown GPU is one line asking for a preset."""
    from areal_libra.cost.presets import PresetError, resolve_cluster_name

    try:
        name = resolve_cluster_name(str(c.libra.control.cluster), c.libra.device)
    except PresetError as e:
        raise LaunchError(f"libra.control.cluster=auto: {e}") from None
    c.libra.control.cluster = name
    return name


def rollout_groups(c: Composed):
    """The run's rollout groups, short to long: `libra.rollout_alloc` (e.g. sglang:d2t1+d1t2) or the
    `libra.rollout_groups` list; bucket thresholds default to an even split of gconfig.max_tokens."""
    from areal_libra.rollout.groups import GroupConfigError, resolve_groups

    try:
        return resolve_groups(c.libra, int(c.areal.gconfig.max_tokens))
    except GroupConfigError as e:
        raise LaunchError(f"libra.rollout_groups: {e}") from None


def _servers(c: Composed):
    from areal_libra.rollout.groups import expand_servers

    # Launch order = address order: group after group (rollout_groups.json records the split).
    return expand_servers(rollout_groups(c))


def emulation(c: Composed):
    """cluster=emulated: the ClusterEmulation, its accelerator budget checked against the rollout groups
    (None on a real cluster)."""
    from areal_libra.rollout.emulation import ClusterEmulation, EmulationError

    try:
        emu = ClusterEmulation.from_libra(c.libra)
        if emu is not None:
            emu.check_layout(rollout_groups(c))
    except EmulationError as e:
        raise LaunchError(f"libra.emulated: {e}") from None
    return emu


def server_specs(c: Composed):
    from areal_libra.rollout.launcher import ServerSpec, libra_sglang_flags

    # Distinct seeds, AReaL's way (its sglang_server.py: base random seed + the server's index on the node).
    # CPU runs keep seed 0 on every embedded server (their measured runs stay comparable).
    seed = int(c.areal.seed) if c.libra.device == "cuda" else 0
    step = 1 if c.libra.device == "cuda" else 0
    # On GPUs every server also gets the flags AReaL's launcher derives from the run's `sglang:` section.
    flags = libra_sglang_flags(c.areal.sglang, lag_bounded(c.libra)) if c.libra.device == "cuda" else ()
    specs = [ServerSpec(tp=g.tp, threads=g.threads, max_running=g.max_running, group=g.name, seed=seed + step * i,
                        extra_args=flags) for i, g in enumerate(_servers(c))]
    emu = emulation(c)
    return specs if emu is None else [emu.emulate_spec(s) for s in specs]


def placement(c: Composed, env: dict[str, str] | None = None, gpu_count: int | None = None):
    """GPU placement of a cuda run: the trainer's device first, then the servers' (disjoint); None on CPU."""
    if c.libra.device != "cuda":
        return None
    from areal_libra.rollout.launcher import _cuda_count
    from areal_libra.rollout.placement import PlacementError, assign_gpus, visible_devices

    count = _cuda_count() if gpu_count is None else gpu_count
    try:
        # One device per trainer process (actor.backend's world size, see trainer_command).
        return assign_gpus(visible_devices(os.environ if env is None else env, count), trainer_gpus(c),
                           [s.tp for s in server_specs(c)])
    except PlacementError as e:
        raise LaunchError(f"cluster GPUs: {e}") from None


def trainer_gpus(c: Composed) -> int:
    """The trainer's processes (one device each on cuda): actor.backend's world size (fsdp:d2t2 -> 4, megatron:
    d1t1p3 -> 3; the launch sizes it from its plan); 1 on CPU, where the trainer is one process."""
    if c.libra.device != "cuda":
        return 1
    from areal_libra.live.live_cluster import ControlError, train_layout

    try:
        return train_layout(str(c.areal.actor.backend))[1].gpus
    except ControlError as e:
        raise LaunchError(str(e)) from None


def trainer_env_overlay(c: Composed, addrs: list[str], gpus: tuple[str, ...] = (),
                        rollout_pool: tuple[str, ...] = (), nproc: int = 1,
                        base: dict[str, str] | None = None) -> dict[str, str]:
    """What the launch sets in the trainer's environment on top of `base` (its own when None)."""
    from areal_libra.utils import free_port

    base = dict(os.environ) if base is None else base
    env = dict(
        AREAL_SPMD_MODE="1",
        AREAL_LLM_SERVER_ADDRS=",".join(addrs),
        # GPUs per server in address order: xccl weight-update ranks for mixed TP (patch 11)
        AREAL_LLM_SERVER_SIZES=",".join(str(g.tp) for g in _servers(c)),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        TOKENIZERS_PARALLELISM="false",
        WANDB_SILENT="true",
        PYTHONUNBUFFERED="1",
    )
    if nproc == 1:  # one process: its rank here; more: torchrun gives each its own (trainer_command)
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    if c.libra.device == "cuda":
        # AReaL's local launcher sets these for the NCCL weight-update group (areal/infra/launcher/local.py).
        env.update(NCCL_CUMEM_ENABLE="0", NCCL_NVLS_ENABLE="0")
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)  # disjoint from every server's
    if rollout_pool:
        from areal_libra.rollout.placement import ROLLOUT_DEVICES_ENV

        env[ROLLOUT_DEVICES_ENV] = ",".join(rollout_pool)
    if c.libra.device == "cpu":
        threads = str(int(c.libra.trainer_threads))
        env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
        env["TORCHDYNAMO_DISABLE"] = "1"  # first-call torch.compile costs 25-55 s on CPU for a tiny model
    if c.areal.stats_logger.wandb.mode == "online" and not base.get("WANDB_API_KEY"):
        env["WANDB_MODE"] = "offline"
    return env


def trainer_env(c: Composed, addrs: list[str], gpus: tuple[str, ...] = (),
                rollout_pool: tuple[str, ...] = (), nproc: int = 1) -> dict[str, str]:
    """`gpus`: the trainer's devices (placement().trainer); LOCAL_RANK 0 is then the first of them.
    `rollout_pool` (placement().pool): the devices servers the trainer starts later may take."""
    env = dict(os.environ)
    env.update(trainer_env_overlay(c, addrs, gpus, rollout_pool, nproc, base=env))
    return env


def trainer_command(run_dir: Path, nproc: int, master_port: str) -> list[str]:
    """The trainer's command line: one process, or `nproc` ranks under torchrun on this node, as AReaL's local
    launcher starts its SPMD trainer (torchrun --nnodes 1 --nproc-per-node N; areal/infra/launcher/local.py)."""
    train = ["-m", "areal_libra.live.train", "--run-dir", str(run_dir)]
    if nproc == 1:
        return [sys.executable, *train]
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", master_port, *train]


def _read_metrics(path: Path, seen: int) -> tuple[list[dict], int]:
    if not path.exists():
        return [], seen
    lines = path.read_text(encoding="utf-8").splitlines()
    out = []
    for line in lines[seen:]:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out, seen + len(out)


def supervise(proc: subprocess.Popen, metrics_path: Path, total: int, servers, quiet: bool,
              run_dir: Path | None = None, revive_grace_s: float = 0.0, tool_servers=(),
              allow_server_loss: bool = False) -> int:
    """Show step, reward, tokens/s and ETA until the trainer exits; fail if every server is dead, at once or,
    when the trainer replaces dead servers (revive_grace_s > 0), if none serves again within that time; fail
    fast if a tool server (`.alive()`, `.log_path`) dies. `allow_server_loss` (libra.allow_server_loss): keep
    going with every server dead."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = [
        TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
    ]
    seen = 0
    all_dead_since: float | None = None
    run_dir = metrics_path.parent if run_dir is None else run_dir
    with Progress(*columns, disable=quiet, transient=False) as progress:
        task = progress.add_task("train", total=total, info="starting trainer ...")
        while True:
            rc = proc.poll()
            recs, seen = _read_metrics(metrics_path, seen)
            for r in recs:
                reward = r.get("reward")
                info = (
                    f"reward {reward:.3f}" if isinstance(reward, (int, float)) else "reward -"
                ) + f"  {r.get('throughput_tokens_per_s', 0):.0f} tok/s  tools {r.get('tool_calls', 0)}"
                if r.get("plan/allocation"):
                    info += f"  {r['plan/allocation']} replans {int(r.get('plan/replans', 0))}"
                progress.update(task, completed=r.get("step", 0), info=info)
                if quiet:
                    print(f"step {r.get('step')}/{total} {info}", flush=True)
            if rc is not None:
                return rc
            for s in servers:
                s.alive()  # reaps a server of ours the trainer stopped (a reconfiguration)
            dead, n_servers = dead_servers(run_dir, servers)
            all_dead = bool(dead) and len(dead) == n_servers
            all_dead_since = (all_dead_since or time.monotonic()) if all_dead else None
            if (all_dead and not allow_server_loss
                    and time.monotonic() - all_dead_since >= revive_grace_s):
                proc.send_signal(signal.SIGTERM)
                raise LaunchError(f"all rollout servers died (first: {dead[0]}); see their logs")
            for t in tool_servers:
                if not t.alive():
                    proc.send_signal(signal.SIGTERM)
                    raise LaunchError(f"a tool server died; see {t.log_path}")
            time.sleep(0.5)


def dead_servers(run_dir: Path, servers) -> tuple[list[str], int]:
    """(addresses of dead serving servers, how many serve): from <run_dir>/servers.json, which the trainer
    keeps current when it reconfigures the rollout groups; the launcher's own servers without it."""
    from areal_libra.rollout.fleet import read_registry
    from areal_libra.utils import pid_alive

    entries = read_registry(run_dir)
    reg = [r for r in entries if r.get("state") == "serving" and r.get("pid")]
    if not reg and any(r.get("state") == "draining" for r in entries):
        return [], 0  # every server is being replaced (break-before-make); the trainer's timeouts bound it
    if not reg:
        return [s.addr for s in servers if not s.alive()], len(servers)
    return [r["addr"] for r in reg if not pid_alive(int(r["pid"]))], len(reg)


def kill_leftover_servers(run_dir: Path) -> list[int]:
    """SIGKILL the process group of every server in servers.json that still runs (started by the trainer,
    which may have died without stopping them). A pid counts only if its command line still names the
    server's port, so a recycled pid is left alone."""
    from areal_libra.rollout.fleet import read_registry
    from areal_libra.utils import pid_alive

    killed = []
    for r in read_registry(run_dir):
        pid, addr = r.get("pid"), str(r.get("addr", ""))
        if not pid or not pid_alive(int(pid)):
            continue
        try:
            cmd = Path(f"/proc/{int(pid)}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        port = addr.rpartition(":")[2].encode()
        if b"--port" not in cmd or cmd[cmd.index(b"--port") + 1 : cmd.index(b"--port") + 2] != [port]:
            continue
        try:
            os.killpg(int(pid), signal.SIGKILL)
            killed.append(int(pid))
        except (ProcessLookupError, PermissionError):
            pass
    return killed


def run(argv: list[str]) -> int:
    c = compose(argv, default_cluster="gpu" if _has_cuda() else "cpu")
    check_dataset(c)
    resolve_control_cluster(c)
    model_path, plan = None, None
    if gpu_planned(c):  # the plan sizes the trainer and the first servers before they are placed, from the
        model_path = resolve_model(c)  # model's own config.json (the dry run may take a preset's shape)
        plan = plan_gpu_layout(c, model_path)
    check_train_backend(c)
    gpus = placement(c)  # before anything starts: an allocation that does not fit is a one-line error
    check_sglang(c)
    emu = emulation(c)  # an emulated layout that does not fit fails before anything starts
    model_path = model_path or resolve_model(c)
    c.areal.actor.path = model_path
    c.areal.tokenizer_path = model_path
    c.areal.rollout.tokenizer_path = model_path
    log_dir = c.log_dir
    log_dir.mkdir(parents=True, exist_ok=True)
    retriever = start_retriever(c, log_dir)  # before the config is saved: the trainer reads its URL there
    try:
        return _run_in(c, log_dir, model_path, gpus, emu, [retriever] if retriever is not None else [], plan)
    finally:
        if retriever is not None:
            retriever.stop()


def gpu_planned(c: Composed) -> bool:
    """A cuda run in libra mode on real GPUs: its launch plan sizes the trainer and the first servers."""
    return c.libra.device == "cuda" and c.libra.mode == "libra" and not c.libra.emulated.enabled


def planning_model(c: Composed) -> tuple[str, Any]:
    """(the model path the servers get, the planner's ModelSpec) without fetching or building anything: the
    config.json of a local directory or of the Hugging Face cache's copy, else the model preset named like the
    id (Qwen/Qwen3-8B -> qwen3-8b); the spec is None when neither is here."""
    from areal_libra.cost.presets import PresetError, load_model
    from areal_libra.live.live_cluster import model_spec_from_hf

    path = str(c.areal.actor.path)
    if path in ("auto", "", "???"):
        from areal_libra.models.tiny import TinyModelConfig, model_dir

        try:
            config = TinyModelConfig.for_task(str(c.libra.model.task))
        except ValueError as e:
            raise LaunchError(f"libra.model.task: {e}") from None
        path = str(model_dir(seed=int(c.libra.model.seed), config=config))
    p = Path(path)
    if not p.is_dir() and _HF_ID.match(path):
        p = _hf_cached(path) or p
    if (p / "config.json").is_file():
        try:
            return str(p), model_spec_from_hf(p)
        except (KeyError, TypeError, ValueError, OSError) as e:
            raise LaunchError(f"actor.path={path}: its config.json is not a decoder model's ({e!r})") from None
    try:
        return path, load_model(path.rstrip("/").rpartition("/")[2].lower())
    except PresetError:
        return path, None


def _hf_cached(repo_id: str) -> Path | None:
    """The Hugging Face cache's snapshot directory of `repo_id` when its config.json is there (no network)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # noqa: BLE001 - a malformed id or cache: not cached
        return None
    return Path(hit).parent if isinstance(hit, str) else None


def _planned_gpus(c: Composed, model_path: str, model: Any) -> int:
    from areal_libra.live.live_cluster import ControlError, plan_source

    try:
        return plan_source(libra_config(c.libra), c.areal, model_path, model=model, train_backend="fsdp").cluster.n_gpus
    except ControlError as e:
        raise LaunchError(str(e)) from None


def plan_gpu_layout(c: Composed, model_path: str, model: Any = None):
    """cuda, libra mode: solve the launch plan (live_cluster.launch_plan: the trainer's engine by
    libra.train_backend and its layout), write its training layout into actor.backend (the trainer's
    processes and AReaL's engine) and, unless libra.rollout_alloc fixes the servers (then the trainer takes the
    GPUs they leave), its rollout mix into libra.rollout_alloc; the Plan (None when not gpu_planned)."""
    if not gpu_planned(c):
        return None
    from areal_libra.live.live_cluster import ControlError, launch_plan

    train_gpus = None
    if c.libra.rollout_alloc:
        n = _planned_gpus(c, model_path, model)
        rollout = sum(g.tp * g.count for g in rollout_groups(c))
        if rollout >= n:
            raise LaunchError(f"libra.rollout_alloc={c.libra.rollout_alloc} takes {rollout} of the planned "
                              f"{n} GPUs and leaves none to the trainer")
        train_gpus = n - rollout
    try:
        plan = launch_plan(libra_config(c.libra), c.areal, model_path, model=model, train_gpus=train_gpus)
    except ControlError as e:
        raise LaunchError(str(e)) from None
    c.areal.actor.backend = plan.train_alloc()
    if not c.libra.rollout_alloc:
        c.libra.rollout_alloc = plan.rollout_alloc()
    return plan


def check_train_backend(c: Composed) -> None:
    """A megatron trainer needs megatron-core (requirements/gpu.txt); static mode runs actor.backend as given,
    which must agree with an explicit libra.train_backend."""
    from areal_libra.live.live_cluster import megatron_available

    if c.libra.device != "cuda":
        return
    backend = str(c.areal.actor.backend).partition(":")[0]
    want = str(c.libra.train_backend)
    if c.libra.mode == "static" and want != "auto" and want != backend:
        raise LaunchError(f"libra.mode=static runs actor.backend as given ({c.areal.actor.backend}), not "
                          f"train_backend={want}: set actor.backend={want}:d..t..p..")
    if backend == "megatron" and not megatron_available():
        raise LaunchError("actor.backend=megatron needs megatron-core, which this environment lacks: run "
                          "`make setup-gpu` (requirements/gpu.txt), or libra.train_backend=fsdp")


def start_retriever(c: Composed, log_dir: Path):
    """`libra.tools.retriever_url=local`: start the project's BM25 retrieval server (health-checked) and
    point the config at it (None otherwise; a given URL must answer a query)."""
    url = c.libra.tools.retriever_url
    if url is None:
        return None
    from areal_libra.workflows.retriever import RetrieverProcess, retrieve

    if url != "local":  # Search-R1's own server has no /health: one real query instead
        try:
            retrieve(url, ["health check"], 1, timeout_s=10.0)
        except (OSError, ValueError) as e:
            raise LaunchError(f"libra.tools.retriever_url={url} does not answer POST /retrieve ({e})") from None
        return None

    corpus = c.libra.tools.corpus
    try:
        proc = RetrieverProcess(log_dir / "retriever.log", corpus=None if corpus is None else str(corpus),
                                timeout_s=600.0 if corpus is not None else 60.0)  # indexing a real corpus
    except RuntimeError as e:
        raise LaunchError(str(e)) from None
    c.libra.tools.retriever_url = proc.url
    print(f"areal_libra: retrieval server {proc.url} (BM25 over {corpus or 'the generated corpus'}, "
          f"log {log_dir / 'retriever.log'})", flush=True)
    return proc


def _run_in(c: Composed, log_dir: Path, model_path: str, gpus, emu, tool_servers: list, plan=None) -> int:
    metrics_path = log_dir / "metrics.jsonl"
    from areal_libra.live.recover import clear_name_resolve, recovered_steps, reset_step_records

    resumed = recovered_steps(c.areal)  # recover.mode=auto|resume with a checkpoint: AReaL resumes after it
    kept = reset_step_records(log_dir, resumed)
    if resumed:
        print(f"areal_libra: recovering after step {resumed} ({kept})", flush=True)
    clear_name_resolve(c.areal)  # a killed trainer's weight-update records would fail the next run's
    save(c, log_dir)
    if c.libra.mode == "libra":
        from areal_libra.live.live_cluster import ControlError, check_feasible

        try:
            summary = plan.summary() if plan is not None else check_feasible(libra_config(c.libra), c.areal,
                                                                             model_path)
        except ControlError as e:
            raise LaunchError(str(e)) from None
        print("areal_libra: libra mode; worst-case plan: " + summary.splitlines()[0].split(": ", 1)[-1]
              + (f"; trainer {c.areal.actor.backend}" if plan is not None else ""), flush=True)
    from areal_libra.rollout.backend import LocalProcessBackend
    from areal_libra.rollout.launcher import shutdown

    quiet = not sys.stdout.isatty()
    print(f"areal_libra: run directory {log_dir}", flush=True)
    print(f"areal_libra: experiment={c.choices.get('experiment')} cluster={c.choices.get('cluster')} "
          f"model={model_path} steps={c.areal.total_train_steps}", flush=True)
    if emu is not None:
        print(f"areal_libra: emulated cluster {emu.describe(rollout_groups(c))}", flush=True)
    if c.libra.ray.address or c.libra.ray.local_nodes:  # cluster=ray / ray_local: areal_libra/ray/run.py
        return _run_on_ray(c, log_dir, model_path, tool_servers)
    backend = LocalProcessBackend.for_device(c.libra.device)  # the fleet's, as build_fleet picks it
    if emu is not None and c.libra.emulated.host:  # one process serving every emulated server
        from areal_libra.rollout.emulated_host import launch_host

        backend, _ = launch_host(emu.model, emu.gpu, emu.time_scale, log_dir)
    servers = backend.start(model_path, server_specs(c), str(log_dir / "servers"),
                            devices=gpus.servers if gpus else None)
    try:
        addrs = [s.addr for s in servers]
        print(f"areal_libra: rollout servers {', '.join(addrs)}", flush=True)
        from areal_libra.rollout.router import write_groups_file

        write_groups_file(log_dir, rollout_groups(c), addrs)  # which address serves which group
        from areal_libra.rollout.fleet import write_registry

        write_registry(log_dir, servers)  # pids; the trainer keeps it current when it reconfigures
        with open(log_dir / "trainer.log", "w") as log:
            nproc = trainer_gpus(c)
            env = trainer_env(c, addrs, gpus.trainer if gpus else (), gpus.pool if gpus else (), nproc)
            proc = subprocess.Popen(
                trainer_command(log_dir, nproc, env["MASTER_PORT"]),
                env=env,
                stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                revive = c.libra.mode == "libra" and bool(c.libra.revive_servers)
                rc = supervise(proc, metrics_path, int(c.areal.total_train_steps or 0), servers, quiet,
                               run_dir=log_dir, revive_grace_s=REVIVE_GRACE_S if revive else 0.0,
                               tool_servers=tool_servers, allow_server_loss=bool(c.libra.allow_server_loss))
            except BaseException:
                _stop(proc)
                raise
            _reap_group(proc.pid)  # the trainer's helpers outlive a trainer that was killed (seen: SIGKILL)
        if rc != 0:
            tail = (log_dir / "trainer.log").read_text(errors="replace").strip().splitlines()[-15:]
            print("\n".join(tail), file=sys.stderr)
            raise LaunchError(f"trainer exited with code {rc}; full log: {log_dir / 'trainer.log'}")
    finally:
        shutdown(servers)
        kill_leftover_servers(log_dir)  # servers the trainer started and did not stop
    print(f"areal_libra: done; metrics in {metrics_path}", flush=True)
    return 0


def _run_on_ray(c: Composed, log_dir: Path, model_path: str, tool_servers: list) -> int:
    """Every process of the run placed by Ray (areal_libra/ray/run.py); the same supervision."""
    from areal_libra.ray.cluster import RayClusterError
    from areal_libra.ray.run import Hooks, run_on_ray

    revive = c.libra.mode == "libra" and bool(c.libra.revive_servers)
    try:
        rc = run_on_ray(c, Hooks(server_specs, trainer_env, supervise, rollout_groups, _worst_case_plan), log_dir,
                        model_path, tool_servers, REVIVE_GRACE_S if revive else 0.0)
    except RayClusterError as e:
        raise LaunchError(str(e)) from None
    if rc != 0:
        tail = (log_dir / "trainer.log").read_text(errors="replace").strip().splitlines()[-15:]
        print("\n".join(tail), file=sys.stderr)
        raise LaunchError(f"trainer exited with code {rc}; full log: {log_dir / 'trainer.log'}")
    print(f"areal_libra: done; metrics in {log_dir / 'metrics.jsonl'}, placement in {log_dir / 'placement.json'}",
          flush=True)
    return 0


def _worst_case_plan(c: Composed, model_path: str):
    """The planner's plan on a worst-case history (as check_feasible solves it): its training layout is the
    one a run on Ray starts its trainer ranks with."""
    from areal_libra.live.live_cluster import plan_source

    src = plan_source(libra_config(c.libra), c.areal, model_path)
    return src.solve([(64, 64 + int(c.areal.gconfig.max_new_tokens))] * 32)


def _reap_group(pgid: int) -> None:
    """SIGKILL what is left of an exited trainer's session (its own process group)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


# What a dry run cannot see without the GPUs (docs/gpu.md lists how each is checked on the node).
CUDA_CHECKS = (
    "the SGLang servers start with these command lines and answer /health (CUDA, sglang with sgl_kernel)",
    "the trainer's engine (AReaL's {engine} at actor.backend={alloc}) initializes on its GPUs and its step fits "
    "in their memory",
    "the xccl weight-update group between the trainer and the servers (NCCL, patch 11's rank offsets)",
    "actor.attn_impl={attn} loads (flash-attn wheels match the CUDA torch)",
)


def dry_run(c: Composed) -> dict:
    """What `launch` would start for this config, started nothing, written nothing: every server's command line
    and the environment the launcher adds (rollout/launcher.plan_servers, the code launch_servers runs), the
    trainer's (trainer_command, trainer_env_overlay), the plan that sized them, and what only a GPU can check."""
    check_dataset(c)
    resolve_control_cluster(c)
    checked = ["config composed and typed", "dataset file and columns" if c.areal.train_dataset.path not in
               (None, "", "generated") else "dataset: generated"]
    not_checked: list[str] = []
    if c.libra.device == "cuda" and str(c.libra.control.cluster) == "cpu":
        raise LaunchError("no GPU here to read the cluster from: a dry run of cluster=gpu needs "
                          "libra.control.cluster=<preset> (e.g. h100x8)")
    model_path, model = planning_model(c)
    if model_path != str(c.areal.actor.path) and str(c.areal.actor.path) not in ("auto", "", "???"):
        checked.append(f"model config.json from the Hugging Face cache ({model_path})")
    elif not Path(model_path).is_dir():
        not_checked.append(f"model weights: {model_path} is not here (not fetched or built by a dry run); the launch "
                           "passes the local directory it fetches or builds as --model-path")
    plan = None
    if gpu_planned(c):
        if model is None:
            raise LaunchError(f"actor.path={c.areal.actor.path}: no config.json here and no model preset of that "
                              "name, so a dry run cannot plan; pass actor.path=/a/local/copy")
        plan = plan_gpu_layout(c, model_path, model)
        checked.append(f"plan fits libra.control.cluster={c.libra.control.cluster}")
    elif c.libra.mode == "libra" and model is not None:  # the CPU / emulated launch's worst-case check
        from areal_libra.live.live_cluster import ControlError, launch_plan

        try:
            plan = launch_plan(libra_config(c.libra), c.areal, model_path, model=model)
        except ControlError as e:
            raise LaunchError(str(e)) from None
        checked.append(f"plan fits libra.control.cluster={c.libra.control.cluster}")
    try:
        check_train_backend(c)
    except LaunchError as e:
        if "megatron-core" not in str(e):
            raise
        not_checked.append("megatron-core imports (not installed here; make setup-gpu installs it)")
    from areal_libra.rollout.launcher import _cuda_count

    count = _cuda_count()
    if c.libra.device == "cuda" and count == 0 and not os.environ.get("CUDA_VISIBLE_DEVICES"):
        count = _planned_gpus(c, model_path, model)
        not_checked.append(f"devices: no CUDA here, the planned cluster's {count} devices 0..{count - 1} assumed")
    gpus = placement(c, gpu_count=count)
    emulation(c)
    from areal_libra.rollout.backend import LocalProcessBackend
    from areal_libra.rollout.launcher import plan_servers
    from areal_libra.rollout.placement import Placement

    # As _run_in starts them: backend.start -> launch_servers -> plan_servers, with the same placement.
    backend = LocalProcessBackend.for_device(c.libra.device)
    launches = plan_servers(model_path, server_specs(c), str(c.log_dir / "servers"), backend=backend.kind,
                            host=backend.host,
                            placement=None if gpus is None else Placement((), tuple(gpus.servers)))
    nproc = trainer_gpus(c)
    env = trainer_env_overlay(c, [sl.addr for sl in launches], gpus.trainer if gpus else (),
                              gpus.pool if gpus else (), nproc)
    if backend.kind == "sglang":
        parsed = sglang_parse([sl.argv for sl in launches])
        (checked if parsed.startswith("parsed") else not_checked).append(parsed)
        engine = "MegatronEngine" if str(c.areal.actor.backend).startswith("megatron") else "FSDPEngine"
        not_checked += [s.format(engine=engine, alloc=c.areal.actor.backend, attn=c.areal.actor.attn_impl)
                        for s in CUDA_CHECKS]
    if nproc > 1:
        not_checked.append(
            f"a trainer of {nproc} ranks under torchrun has not run on GPUs: every data-parallel head rolls out "
            "through its own router; ranks above 0 follow rank 0's fleet (live/rank_follower.py, run with 2 gloo "
            "ranks on Ray) and only rank 0's trajectories feed the planner (docs/gpu.md)")
    out: dict[str, Any] = {
        "run_dir": str(c.log_dir),
        "servers": [{"argv": sl.argv, "env": sl.env, "addr": sl.addr, "gpus": list(sl.gpus), "group": sl.spec.group}
                    for sl in launches],
        "trainer": {"argv": trainer_command(c.log_dir, nproc, env["MASTER_PORT"]), "env": env,
                    "gpus": list(gpus.trainer) if gpus else [], "actor_backend": str(c.areal.actor.backend)},
        "plan": None,
        "checked": checked,
        "not_checked": not_checked,
    }
    if plan is not None:
        out["plan"] = plan.to_json() | {"n_gpus": plan.n_gpus, "idle_gpus": plan.idle_gpus,
                                        "actor_backend": plan.train_alloc(), "rollout_alloc": plan.rollout_alloc(),
                                        "summary": plan.summary().splitlines()[:3]}
    return out


def sglang_parse(argvs: list[list[str]]) -> str:
    """Every server command line through the installed SGLang's own ServerArgs (rollout/sglang_args.py):
    'parsed ...' or why it could not be; LaunchError when SGLang refuses one."""
    from importlib.metadata import version

    try:
        parse_command_lines([argv[3:] for argv in argvs])  # after `python -m sglang.launch_server`
    except SGLangUnavailable as e:
        return f"server command lines not parsed by SGLang's ServerArgs: {e}"
    except SGLangArgsError as e:
        raise LaunchError(str(e)) from None
    return f"parsed: every server command line by sglang {version('sglang')}'s ServerArgs"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0
    try:
        if "--dry-run" in argv:
            c = compose([a for a in argv if a != "--dry-run"], default_cluster="gpu" if _has_cuda() else "cpu")
            print(json.dumps(dry_run(c), indent=1))
            return 0
        return run(argv)
    except (ConfigError, LaunchError) as e:
        print(f"areal_libra: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("areal_libra: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
