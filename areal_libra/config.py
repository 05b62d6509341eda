"""Compose and validate an experiment config: hydra tree under experiments/, AReaL key names.

The composed tree has AReaL 1.0.4 `GRPOConfig` keys at the top level and this project's keys under
`libra:`, typed by the `LibraConfig` dataclass tree below. Both are merged with OmegaConf.structured, as
AReaL does with its GRPOConfig, so an unknown or mistyped key is a one-line error at launch.
"""

from __future__ import annotations

import getpass
import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from areal_libra.cmlfq import aging
from areal_libra.cmlfq.policy import CMLFQConfig
from areal_libra.control.controller import ControlConfig
from areal_libra.control.profile import PROFILE_GROUPS
from areal_libra.elastic_runtime.settings import RuntimeConfig
from areal_libra.utils import atomic_write_text
from areal_libra.utils import first_line as _msg

CONFIG_DIR = Path(__file__).resolve().parent.parent / "experiments"
GROUPS = ("experiment", "cluster", "model")
TRAIN_BACKENDS = ("auto", "fsdp", "megatron")  # libra.train_backend


class ConfigError(ValueError):
    """A bad experiment name, override or value; the message is one line for the user."""


# ---------------------------------------------------------------- the `libra:` schema
@dataclass
class DatasetConfig:
    n_problems: int = 4096  # the generator's size (train_dataset.path=generated)
    seed: int = 1
    # (path, size, seed, max_rows) -> datasets.Dataset; path is train_dataset.path (None for the generator)
    builder: str = "areal_libra.workflows.math_data.load_math_dataset"
    max_rows: int | None = None  # a file dataset's row cap; None: every row

    def __post_init__(self) -> None:
        if self.max_rows is not None and self.max_rows < 1:
            raise ValueError(f"dataset.max_rows must be >= 1 or null, got {self.max_rows}")


@dataclass
class ModelConfig:
    builder: str = "areal_libra.models.tiny"
    seed: int = 1  # the starting checkpoint's own seed: runs with different `seed=` start from the same policy
    task: str = "math"  # the tiny model's warm-up task: math | code (areal_libra.models.warmup.get_task)


@dataclass
class ToolsConfig:
    """`libra.tools`: the tools' servers (search_r1's retriever)."""

    # "local": the launch starts the project's BM25 retrieval server (areal_libra.workflows.retriever_server)
    # on 127.0.0.1 and stops it at the end; a URL (http://host:port): an existing Search-R1 style server.
    retriever_url: str | None = None
    # "local" only: a Search-R1 corpus (JSONL of {"id", "contents"}) the BM25 server indexes; None: the
    # generated corpus (areal_libra.workflows.search_corpus)
    corpus: str | None = None
    retriever_topk: int = 2
    retriever_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        url = self.retriever_url
        if url is not None and url != "local" and not url.startswith(("http://", "https://")):
            raise ValueError(f"tools.retriever_url must be 'local' or an http(s) URL, got {url!r}")
        if self.retriever_topk < 1 or self.retriever_timeout_s <= 0:
            raise ValueError("tools.retriever_topk must be >= 1 and tools.retriever_timeout_s > 0")


@dataclass
class RolloutGroupConfig:
    name: str = ""
    tp: int = 1
    count: int = 1
    threads: int | None = None  # CPU threads of each embedded server; None: = tp
    max_running: int = 256
    max_len: int = 0  # bucket threshold; 0: an even split of gconfig.max_tokens


@dataclass
class DispatchConfig:
    """`libra.scheduler`: the request router patched into AReaL (areal_libra.rollout.router)."""

    policy: str = "cmlfq"  # cmlfq | mlfq | predictor | least_loaded | oracle | round_robin (AReaL's own)
    sticky: bool = True  # stay on one server inside a group (its prefix cache holds the context)
    health_interval_s: float = 2.0
    health_timeout_s: float = 5.0
    fail_after: int = 3  # consecutive failed probes before a server is marked down
    ok_after: int = 2  # consecutive good probes before it is re-admitted
    watch_interval_s: float = 0.5  # how often an in-flight request checks its server's health
    failover_wait_s: float = 120.0  # how long a request waits for any healthy server
    max_failovers: int = 8  # per request
    rebuild_every_steps: int = 1  # live-tree rebuild + save period (0: never rebuild)
    rebuild_window: int = 5000
    online_siblings: bool = False
    # Load-aware spill-over between neighbouring TP buckets on placements (cmlfq/spill.py), the simulator's
    # default (SimKnobs.spill_ratio): a bucket more than ratio x as loaded per GPU as its neighbour (plus one)
    # sends new placements there. None: off (every request where the policy puts it).
    spill_ratio: float | None = 1.2
    wandb: bool = True  # also log the step metrics into the active W&B run (AReaL's, on rank 0)
    # The cmlfq policy's settings; live, its auto mode validates in a background thread (no stall at the step
    # boundary), this context's setting of CMLFQConfig.auto_background.
    cmlfq: CMLFQConfig = field(default_factory=lambda: CMLFQConfig(auto_background=True, fallback=True))

    def __post_init__(self) -> None:
        if self.spill_ratio is not None and not self.spill_ratio >= 1:
            raise ValueError(f"libra.scheduler.spill_ratio must be >= 1 (or null), got {self.spill_ratio}")
        if isinstance(self.cmlfq, dict):  # a mapping (RemoteRouter's JSON body, tests): the same typed section
            default = DispatchConfig.__dataclass_fields__["cmlfq"].default_factory()
            self.cmlfq = _dataclass_from(CMLFQConfig, self.cmlfq, "libra.scheduler.cmlfq", base=default)

    @classmethod
    def from_mapping(cls, d: Any) -> DispatchConfig:
        return _dataclass_from(cls, d, "libra.scheduler")


def _dataclass_from(cls: type, d: Any, where: str, base: Any = None) -> Any:
    """cls (or `base` with these fields replaced) from a mapping; an unknown key is a one-line ValueError."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(cls)}
    kw = dict(d)
    unknown = sorted(set(kw) - names)
    if unknown:
        raise ValueError(f"{where}.{unknown[0]}: unknown key (known: {', '.join(sorted(names))})")
    return dataclasses.replace(base, **kw) if base is not None else cls(**kw)


@dataclass
class LiveElasticConfig:
    """`libra.elastic`: the Elastic Hybrid Pool in a live run (areal_libra.live.elastic_live)."""

    enabled: bool = False
    hybrids: int = 1
    # A fixed script instead of the measured policy (demonstrations, tests): the controller's elastic policy is
    # then elastic.policy.ScheduledPolicy (join from this step; release `release_after` steps after training).
    join_at_step: int | None = None
    release_after: int | None = None
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)  # the elastic runtime (heartbeats, timeouts)
    worker_start_timeout_s: float = 600.0
    serve: bool = True  # a hybrid in rollout serves requests (needs the request router: policy != round_robin)
    server_threads: int = 1  # CPU threads of a hybrid's embedded server
    server_max_running: int = 64
    rollout_group: str = ""  # router group a hybrid's server joins ("": the one with the largest max_len)
    serve_ack_timeout_s: float = 30.0  # a draining hybrid waits this long for the trainer to stop routing to it
    # The pool sized with the first plan, as the simulator's Libra sizes it (sim/libra.py hybrid_from_train):
    # min(hybrids, (DP - 1) // 2) of the plan's training replicas (tp x pp accelerators each) are hybrids,
    # built when the first plan is applied and training from then on (each joins once its worker is ready);
    # off in static mode (the static system has none). The emulated host's default (cluster=emulated_host).
    size_with_plan: bool = False
    # T_rollout from the rollout side's idle time (RolloutIdleClock; the live default, for a small staleness
    # bound where no backlog forms); false: the simulator's rule on the trainer's wait and the backlog of
    # finished groups (elastic.measure.rollout_time), e.g. on the emulated host at the simulator's staleness 4.
    rollout_clock: bool = True

    def __post_init__(self) -> None:
        if (self.join_at_step is not None and self.join_at_step < 0) or (
                self.release_after is not None and self.release_after < 1):
            raise ValueError("libra.elastic.join_at_step must be >= 0 and release_after >= 1")
        if self.hybrids < 0 or self.server_threads < 1 or self.server_max_running < 1:
            raise ValueError("libra.elastic: hybrids >= 0, server_threads >= 1 and server_max_running >= 1")


@dataclass(frozen=True)
class ControlSettings(ControlConfig):
    """`libra.control`: the shared controller's settings (areal_libra.control.ControlConfig, declared there:
    replan_policy.every_k, replan_policy.reconfig_cost_s, settle_steps, elastic_persist, elastic_policy, ...)
    and what the live planner plans on (areal_libra.live.live_cluster)."""

    # The profiling pass before step 1 (control.profile, as the simulator's): this many prompts' groups of the
    # initial policy run to their end, the first plan solved on all of them; 0: no pass, the first plan from
    # the trajectories finished by step profile_steps (biased to those that finish first).
    profile_groups: int = PROFILE_GROUPS
    profile_steps: int = 1
    # The cost preset the planner plans on (a cluster preset or YAML); "auto": the machine's GPUs (model and
    # count, areal_libra.cost.presets.detect_cluster) on a cuda run, the cpu preset on the embedded CPU cluster.
    cluster: str = "auto"
    accelerators: int = 0  # size of the planned cluster; 0: the preset's
    allowed_tp: list[int] = field(default_factory=lambda: [1, 2])

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.profile_steps < 1 or self.accelerators < 0 or self.profile_groups < 0:
            raise ValueError("control.profile_steps must be >= 1, control.profile_groups and control.accelerators "
                             ">= 0")
        if not self.allowed_tp or any(t < 1 or t & (t - 1) for t in self.allowed_tp):
            raise ValueError(f"control.allowed_tp must be powers of two >= 1, got {list(self.allowed_tp)}")


@dataclass
class RayConfig:
    """`libra.ray` (cluster=ray, cluster=ray_local): every process of the run placed by Ray placement groups
    (areal_libra/ray/). Accelerators are Ray's custom resource "accel" (CPU nodes declare it; see README)."""

    address: str | None = None  # None: not on Ray; "auto": the running cluster (RAY_ADDRESS, ray start); host:port
    local_nodes: int = 0  # cluster=ray_local: Ray nodes this command starts on this host (and stops)
    local_cpus: int = 1  # each local node's CPUs
    local_accel: int = 4  # each local node's accelerators (the "accel" resource)
    trainer_ranks: int = 0  # trainer processes (FSDP data parallel); 0: the planner's training layout
    max_trainer_ranks: int = 2  # a cap on the planner's layout (a CPU host's cores); 0: none
    timeout_s: float = 120.0  # connecting, and placing every placement group
    # chaos (ray_local only): kill the raylet of the node that holds only rollout servers at this step
    kill_node_at_step: int | None = None

    def __post_init__(self) -> None:
        if self.local_nodes < 0 or self.local_cpus < 1 or self.local_accel < 0:
            raise ValueError("ray.local_nodes must be >= 0, ray.local_cpus >= 1 and ray.local_accel >= 0")
        if self.trainer_ranks < 0 or self.max_trainer_ranks < 0 or self.timeout_s <= 0:
            raise ValueError("ray.trainer_ranks and ray.max_trainer_ranks must be >= 0, ray.timeout_s > 0")


@dataclass
class EmulatedConfig:
    """`libra.emulated` (cluster=emulated): N emulated accelerators paced to a real model on real hardware
    (the simulator's hardware truth), see areal_libra.rollout.emulation."""

    enabled: bool = False
    accelerators: int = 16
    model: str = "qwen3-14b"  # a model preset (areal_libra/presets/models.yaml)
    gpu: str = "h200"  # a hardware preset (areal_libra/presets/hardware.yaml)
    time_scale: float = 4.0  # real seconds per emulated second (1.0 overruns on a 2-core machine)
    trainer_accelerators: int | None = None  # None: every accelerator the rollout servers leave
    server_threads: int = 1  # CPU threads per emulated server (its speed comes from the pacing)
    length_growth: float = 0.0  # emulated lengths grow to (1 + length_growth)x over growth_horizon steps
    growth_horizon: int = 40
    # host: the servers are emulated ones inside one process (rollout/emulated_host.py) that run no model;
    # the workflow (areal_libra.rollout.emulated_workflow) plays `workload`'s trajectories (sim/workloads.py).
    host: bool = False
    workload: str = "search_r1"  # search_r1 | dapo_math | r2e_gym | a trace file
    seed: int = 0  # the workload generator's seed
    # The trainer's real PPO update runs on this many sequences of each batch (0: all of them); the pacing
    # counts the whole batch. A stand-in keeps AReaL's loop, staleness and weight updates with negligible compute.
    train_sample: int = 0
    # The planner plans on the emulated accelerators as a profiling pass measures them (the cost preset fitted
    # to samples of the emulated hardware: rollout.emulation.profiled_hardware), as the simulator's Libra does;
    # false: the preset's spec sheet as it is.
    profile_planner: bool = False


@dataclass
class LibraConfig:
    """Everything under `libra:` in the experiment tree. Unknown or mistyped keys fail at launch."""

    mode: str = "libra"  # libra: planner + re-plan + elastic + C-MLFQ drive the run; static: AReaL as is
    device: str = "cpu"  # cpu: embedded servers; cuda: SGLang
    # The trainer's engine on cuda (AReaL's actor.backend, sized by the launch's plan): fsdp (fsdp:dXtY, no
    # pipeline) | megatron (AReaL's MegatronEngine, megatron:dXtYpZ) | auto: megatron when the plan's best layout
    # needs TP or PP > 1 and megatron-core imports, else fsdp (live/live_cluster.launch_plan). The CPU trainer is
    # one FSDP process; the elastic pool supports a single-rank fsdp:d1 trainer only.
    train_backend: str = "auto"
    trainer_threads: int = 1
    workflow: str = "areal_libra.workflows.math_tool.MathToolWorkflow"
    max_turns: int = 3
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    rollout_alloc: str | None = None  # e.g. embedded:d2t1+d1t2 (wins over rollout_groups)
    rollout_groups: list[RolloutGroupConfig] = field(default_factory=lambda: [RolloutGroupConfig(name="g0")])
    scheduler: DispatchConfig = field(default_factory=DispatchConfig)
    elastic: LiveElasticConfig = field(default_factory=LiveElasticConfig)
    emulated: EmulatedConfig = field(default_factory=EmulatedConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    control: ControlSettings = field(default_factory=ControlSettings)
    revive_servers: bool = True  # libra mode: a rollout server that dies is replaced (rollout/revive.py)
    # The launcher keeps supervising when every rollout server is dead (chaos tests; it stops the run otherwise,
    # after the revival grace in libra mode). Was the environment variable AREAL_LIBRA_ALLOW_SERVER_LOSS=1.
    allow_server_loss: bool = False
    # libra mode: no trajectory is trained more than eta (AReaL's max_head_offpolicyness) versions after it
    # started. The trainer's executor waits for a group at the bound (patch 14, live/lag_bound.py), every
    # request carries its trajectory's start version as priority (rollout/router.py, patch 15), and SGLang
    # servers order their waiting queues by it (cmlfq.aging.SGLANG_FLAGS); the simulated Libra's rule.
    bound_lag: bool = aging.BOUND_LAG
    # libra mode: a new group starts only while the running trajectories' contexts fit the rollout servers' KV
    # cache (patch 17, live/admission.py, cmlfq.aging.admit_group); the simulated Libra's rule.
    working_set_admission: bool = aging.WORKING_SET_ADMISSION

    def __post_init__(self) -> None:
        if self.mode not in ("libra", "static"):
            raise ValueError(f"mode must be libra or static, got {self.mode!r}")
        if self.train_backend not in TRAIN_BACKENDS:
            raise ValueError(f"train_backend must be one of {', '.join(TRAIN_BACKENDS)}, got {self.train_backend!r}")
        if self.train_backend == "megatron" and self.device != "cuda":
            raise ValueError("train_backend=megatron needs libra.device=cuda (cluster=gpu): megatron-core's engine "
                             "runs on CUDA only; the CPU trainer is one FSDP process")
        if self.train_backend == "megatron" and self.elastic.enabled:
            raise ValueError("libra.elastic supports a single-rank fsdp trainer only (fsdp:d1, whose gradient domain "
                             "its replicas join); use train_backend=fsdp or auto, or libra.elastic.enabled=false")
        if self.mode == "static" and self.elastic.enabled and self.elastic.size_with_plan:
            self.elastic = replace(self.elastic, enabled=False)  # libra mode's pool: none in static
        if self.mode == "static" and self.elastic.enabled:
            raise ValueError("libra.elastic.enabled needs libra.mode=libra: the LibraController decides the "
                             "pool's joins and releases")


@dataclass
class Composed:
    areal: DictConfig  # validated against areal.api.cli_args.GRPOConfig
    libra: DictConfig
    choices: dict[str, str]

    @property
    def log_dir(self) -> Path:
        c = self.areal
        return Path(f"{c.cluster.fileroot}/logs/{getpass.getuser()}/{c.experiment_name}/{c.trial_name}")


def lag_bounded(libra: Any) -> bool:
    """Whether a run bounds its version lag (LibraConfig.bound_lag, libra mode only): the executor's rule, the
    router's request priority and the SGLang servers' priority flags all follow this one answer."""
    return libra.mode == "libra" and bool(libra.bound_lag)


def available(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def _split(overrides: list[str]) -> tuple[dict[str, str], list[str]]:
    choices, rest = {}, []
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"override '{ov}' is not of the form key=value")
        key, val = ov.split("=", 1)
        key = key.lstrip("+")
        if key in GROUPS:
            if val not in available(key):
                raise ConfigError(f"unknown {key} '{val}' (available: {', '.join(available(key))})")
            choices[key] = val
        else:
            rest.append(f"{key}={val}")
    return choices, rest


def compose(overrides: list[str], default_cluster: str = "cpu") -> Composed:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    choices, rest = _split(overrides)
    choices.setdefault("cluster", default_cluster)
    choices.setdefault("experiment", "dapo_math")
    choices.setdefault("model", "tiny_qwen2")
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        raw = hydra_compose(config_name="config", overrides=[f"{k}={v}" for k, v in choices.items()])
    OmegaConf.set_struct(raw, False)
    # libra's interpolations (e.g. dataset.seed: ${seed}) resolve against the composed YAML, as before typing,
    # so a top-level override they read (seed=2) must be in that YAML before they resolve.
    for ov in rest:
        key, val = ov.split("=", 1)
        if "." not in key and key in raw and not OmegaConf.is_config(raw[key]):
            raw[key] = OmegaConf.from_dotlist([ov])[key]
    try:
        libra_raw = OmegaConf.to_container(raw.pop("libra", OmegaConf.create({})), resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f"libra config cannot be resolved: {_msg(e)}") from None
    # AReaL's schema only now: importing it (torch, transformers) takes ~10 s, and a mistyped experiment,
    # cluster or model choice is reported above without it; so is a key that is neither AReaL's (by the shape
    # of its schema cached from an earlier run) nor libra's.
    try:
        libra = OmegaConf.merge(_schema(), libra_raw)
    except OmegaConfBaseException as e:
        raise ConfigError(f"libra config: {_msg(e)}") from None
    _check_keys_early(libra, rest)
    from areal.api.cli_args import GRPOConfig

    schema = OmegaConf.structured(GRPOConfig)
    _cache_key_shape(schema)
    try:
        areal = OmegaConf.merge(schema, raw)
    except OmegaConfBaseException as e:
        raise ConfigError(f"experiment config does not match AReaL's GRPOConfig: {_msg(e)}") from None
    OmegaConf.set_struct(areal, True)
    OmegaConf.set_struct(libra, True)
    has_trial = False
    for ov in rest:
        key, val = ov.split("=", 1)
        has_trial |= key == "trial_name"
        # AReaL keys keep AReaL's names; project keys may be given with or without `libra.`.
        if key.startswith("libra."):
            libra = _override(libra, key[len("libra.") :], val, ov)
            continue
        try:
            areal = _override(areal, key, val, ov)
        except _UnknownKey:
            try:
                libra = _override(libra, key, val, ov)
            except _UnknownKey:
                raise unknown_key_error(key) from None
    if not has_trial:
        areal.trial_name = time.strftime("t%Y%m%d_%H%M%S")
    # Mirror the root trial/experiment names into every sub-config that carries them.
    for sect in ("rollout", "actor", "saver", "recover", "evaluator", "stats_logger"):
        if sect in areal and areal[sect] is not None and "trial_name" in areal[sect]:
            areal[sect].trial_name = areal.trial_name
            areal[sect].experiment_name = areal.experiment_name
    try:
        OmegaConf.resolve(areal)
        OmegaConf.resolve(libra)
    except OmegaConfBaseException as e:
        raise ConfigError(f"config cannot be resolved: {_msg(e)}") from None
    libra_config(libra)  # the dataclasses' own checks
    return Composed(areal=areal, libra=libra, choices=choices)


def _schema() -> DictConfig:
    """The `libra:` schema as an OmegaConf tree. OmegaConf makes the nodes of frozen dataclasses (the
    controller's and the policies' settings) read-only; overrides must merge into them, and to_object builds
    the frozen objects again (their __post_init__ checks run there)."""
    schema = OmegaConf.structured(LibraConfig)

    def writable(node: Any) -> None:
        OmegaConf.set_readonly(node, None)
        if OmegaConf.is_dict(node):
            for k in node:
                child = node._get_node(k)
                if OmegaConf.is_config(child):
                    writable(child)
        elif OmegaConf.is_list(node):
            for i in range(len(node)):
                child = node._get_node(i)
                if OmegaConf.is_config(child):
                    writable(child)

    writable(schema)
    return schema


def load_run_config(run_dir: Path) -> LibraConfig:
    """The typed `libra:` config a launch saved in its run directory (libra_config.yaml, see save())."""
    return libra_config(OmegaConf.load(Path(run_dir) / "libra_config.yaml"))


def libra_config(cfg: Any) -> LibraConfig:
    """The `libra:` tree as a typed LibraConfig (from a composed DictConfig, a saved YAML's, or a dict)."""
    if isinstance(cfg, LibraConfig):
        return cfg
    try:
        merged = OmegaConf.merge(_schema(), cfg)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(f"libra config: {_msg(e)}") from None
    except ValueError as e:
        raise ConfigError(f"libra config: {e}") from None


class _UnknownKey(ConfigError):
    pass


def unknown_key_error(key: str) -> ConfigError:
    return ConfigError(f"unknown config key '{key}' (neither an AReaL GRPOConfig key nor a libra key)")


# --- keys checked before AReaL's schema is imported ---------------------------------------------------------
# A schema's shape: {field: shape} for a dataclass node, OPEN where any key may follow (a dict field, an
# optional dataclass left None, a leaf the override would replace: OmegaConf decides those after the import).
OPEN = "*"


def key_shape(node: Any) -> Any:
    """The key shape of an OmegaConf node (a structured config or any node under it)."""
    if not OmegaConf.is_dict(node) or node._is_none() or node._is_missing():
        return OPEN
    if node._metadata.object_type in (None, dict):
        return OPEN
    return {str(k): key_shape(node._get_node(k)) for k in node.keys()}


def shape_rejects(shape: Any, key: str) -> bool:
    """True when `key` (dotted) certainly names no field of a config of this shape: some component is not a field
    of the dataclass node it lands on."""
    for part in key.split("."):
        if shape == OPEN:
            return False
        if part not in shape:
            return True
        shape = shape[part]
    return False


def _key_shape_path() -> Path | None:
    """Where the shape of the installed AReaL's GRPOConfig is cached: keyed by the bytes of its cli_args.py (found
    without importing AReaL), so a patched or upgraded AReaL gets its own entry. None when it cannot be found."""
    import hashlib
    from importlib.metadata import PackageNotFoundError, distribution

    from areal_libra.utils import cache_root

    try:
        src = Path(distribution("areal").locate_file("areal/api/cli_args.py"))
        digest = hashlib.sha256(src.read_bytes()).hexdigest()[:16]
    except (PackageNotFoundError, OSError):
        return None
    return cache_root() / "config" / f"areal-grpo-keys-{digest}.json"


def _cache_key_shape(schema: DictConfig) -> None:
    """Keep the shape of AReaL's GRPOConfig for the next run's early check (_key_shape_path); a cache
    that cannot be written only costs the next typo the import."""
    path = _key_shape_path()
    if path is None or path.is_file():
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(key_shape(schema), sort_keys=True))
    except OSError:
        pass


def _check_keys_early(libra: DictConfig, overrides: list[str]) -> None:
    """Before AReaL's schema is imported: a `libra.` override is merged into the libra config (`libra`: the
    experiment's, typed) as it will be later (the same errors), and a key that is neither AReaL's nor libra's is
    refused when this AReaL's key shape is cached (otherwise, or with an unreadable cache, the full check after
    the import decides)."""
    path = _key_shape_path()
    try:
        areal_shape = json.loads(path.read_text()) if path is not None else None
    except (OSError, ValueError):
        areal_shape = None
    if not isinstance(areal_shape, dict):
        areal_shape = None  # nothing cached: only the libra. overrides are checked here
    libra_shape = key_shape(libra) if areal_shape is not None else None
    for ov in overrides:
        key, val = ov.split("=", 1)
        if key.startswith("libra."):
            _override(libra, key[len("libra."):], val, ov)
        elif areal_shape is not None and shape_rejects(areal_shape, key) and shape_rejects(libra_shape, key):
            raise unknown_key_error(key)


def _override(cfg: DictConfig, key: str, val: str, ov: str) -> DictConfig:
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    try:
        return OmegaConf.merge(cfg, OmegaConf.from_dotlist([f"{key}={val}"]))
    except (ConfigKeyError, ConfigAttributeError) as e:
        raise _UnknownKey(f"unknown config key '{key}': {_msg(e)}") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"bad override '{ov}': {_msg(e)}") from None


def save(composed: Composed, run_dir: Path) -> tuple[Path, Path]:
    """Write the AReaL config and the project's config where the trainer reads them (atomic)."""

    run_dir.mkdir(parents=True, exist_ok=True)
    a, b = run_dir / "areal_config.yaml", run_dir / "libra_config.yaml"
    atomic_write_text(a, OmegaConf.to_yaml(composed.areal))
    atomic_write_text(b, OmegaConf.to_yaml(composed.libra))
    return a, b
