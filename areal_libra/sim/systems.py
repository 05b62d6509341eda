"""The systems the simulator compares: baselines users would pick, Libra, and Libra's ablation ladder.

Each system is a layout (training topology + rollout servers), a run mode (synchronous / colocated /
staleness-bounded asynchronous), a routing policy (from areal_libra.cmlfq) and a controller that
sees only what a live system sees after each step (finished trajectories, measured times) and may
reconfigure: the Global Resource Planner and its re-plan gate (areal_libra.planner), the elastic pool
policy (areal_libra.elastic). Nothing here re-implements those algorithms; it only wires them up.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from areal_libra.control.profile import PROFILE_GROUPS
from areal_libra.sim.cluster import Controller, Layout, Router, RunConfig, SimError, Simulation, TrainLayout, gc_paused
from areal_libra.sim.hardware import HardwareTruth
from areal_libra.sim.server import SimRequest
from areal_libra.sim.workloads import Workload

SYSTEMS = ("verl_colocated", "verl_static_uniform", "verl_greedy", "areal_static_optimal", "static_libra_loop",
           "libra")
LADDER = ("static_uniform", "+planner", "+hetero_tp", "+cmlfq", "+elastic")

BASELINE_ROLLOUT_TP = 2  # verl's Qwen3-14B example scripts: rollout tensor_model_parallel_size=2
AREAL_STALENESS = 4  # AReaL max_head_offpolicyness used by AReaL-Static-Optimal and Libra
VERL_STALENESS = 1  # verl's one-step off-policy recipe for disaggregated placements


@dataclass(frozen=True)
class SimKnobs:
    """The simulator's switches for Libra's ablations (`--knob key=value` on the evaluation CLIs)."""

    spill_ratio: float | None = 1.2  # C-MLFQ load-aware spill-over ratio; None: off
    planner_mode: str = "async"  # the planner's rollout objective: async | window
    train_micro_batch: bool = True  # the simulated trainer runs the plan's micro-batch size
    hybrid_dp_div: int = 2  # at most (dp - 1) // hybrid_dp_div training replicas are elastic
    # The controller's settings (areal_libra.control.ControlConfig); None: its own default.
    elastic_persist: int | None = None  # steps an elastic verdict must persist before the pool acts
    elastic_project: bool | None = None  # the elastic policy's overshoot check
    replan: bool | None = None  # re-planning in every Libra rung (false: the first plan stays)
    cmlfq_mode: str = "fixed"  # fixed: the published switches (overrun on); auto: C-MLFQ's auto mode

    def __post_init__(self) -> None:
        if self.cmlfq_mode not in ("fixed", "auto"):
            raise ValueError(f"knob cmlfq_mode must be fixed or auto, got {self.cmlfq_mode!r}")
        if self.planner_mode not in ("async", "window"):
            raise ValueError(f"knob planner_mode must be async or window, got {self.planner_mode!r}")
        if self.hybrid_dp_div < 1:
            raise ValueError("knob hybrid_dp_div must be >= 1")
        if self.elastic_persist is not None and self.elastic_persist < 1:
            raise ValueError("knob elastic_persist must be >= 1")
        if self.spill_ratio is not None and self.spill_ratio <= 1:
            raise ValueError(f"knob spill_ratio must be > 1 (or null), got {self.spill_ratio}")


def parse_knobs(items: list[str]) -> SimKnobs:
    """`key=value` strings (null turns spill_ratio off) -> SimKnobs; a bad key or value raises ValueError."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    bad = [i for i in items if "=" not in i]
    if bad:
        raise ValueError(f"--knob {bad[0]!r} is not of the form key=value")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(SimKnobs), OmegaConf.from_dotlist(items))
        return SimKnobs(**OmegaConf.to_container(merged))
    except OmegaConfBaseException as e:
        raise ValueError(f"bad --knob: {str(e).strip().splitlines()[0]}") from None


@dataclass
class Env:
    """What a system is built for: the cluster, model, workload and the hardware truth to run on."""

    truth: HardwareTruth
    workload: Workload
    n_gpus: int
    cluster: object | None = None  # areal_libra.cost.presets.ClusterSpec when the planner is used
    model: object | None = None  # areal_libra.cost.presets.ModelSpec
    seed: int = 0
    profile_groups: int = PROFILE_GROUPS  # the profiling pass before the first plan (control.profile)
    knobs: SimKnobs = field(default_factory=SimKnobs)
    staleness: int = AREAL_STALENESS  # eta of AReaL-Static-Optimal and Libra (the regime map sweeps it)
    # AReaL's max_concurrent_rollouts for both (RunConfig.max_concurrent_groups: 0 none, None AReaL's default)
    max_concurrent_groups: int | None = 0


def areal_run_config(env: Env, **fields) -> RunConfig:
    """AReaL's loop as the run sets it (eta, the concurrency cap), for every system built on it."""
    return RunConfig(max_staleness=env.staleness, max_concurrent_groups=env.max_concurrent_groups, **fields)


@dataclass
class SystemSpec:
    name: str
    layout: Layout
    run: RunConfig
    router_factory: Callable[[Layout], Router]
    controller: Controller = field(default_factory=Controller)
    extra: dict = field(default_factory=dict)  # reported with the system's results (e.g. the sweep's candidates)


# ------------------------------------------------------------------ routing adapters
class PolicyRouter(Router):
    """Feeds the simulator's requests to an areal_libra.cmlfq routing policy."""

    def __init__(self, policy, spill_cfg=None):
        self.policy = policy
        self.n_buckets = len(policy.buckets)
        from areal_libra.cmlfq import LeastLoadedPolicy, RequestInfo

        self._info = RequestInfo
        # A policy whose tool_return is least-loaded's keeps every trajectory in its bucket and reads nothing
        # of the request: tool_return skips building the request for it (once per tool return).
        self._keeps_bucket = type(policy).tool_return is LeastLoadedPolicy.tool_return
        # Load-aware spill-over (areal_libra.cmlfq.spill, as the live Dispatcher's `spill` switch):
        # placements go to a neighbouring bucket when the chosen one is much more loaded per GPU.
        self.spill_cfg = spill_cfg
        self.sim = None

    def bind(self, sim) -> None:
        self.sim = sim
        if hasattr(self.policy, "fallback_active") and self.policy.load_fn is None:
            self.policy.load_fn = self._loads  # C-MLFQ's fallback and price read the buckets' load per GPU

    def _count(self) -> None:
        """One routing decision by C-MLFQ: the simulation counts how many its fallback made."""
        if self.sim is not None and hasattr(self.policy, "fallback_active"):
            self.sim.route_decisions += 1
            self.sim.fallback_decisions += bool(self.policy.fallback_active)

    def _loads(self) -> list[float]:
        n = self.n_buckets
        load, gpus = [0.0] * n, [0.0] * n
        for s in self.sim.servers if self.sim is not None else ():
            if s.bucket < n and not s.retired:
                load[s.bucket] += s.load()
                gpus[s.bucket] += s.tp
        return [x / g if g else float("inf") for x, g in zip(load, gpus)]

    def _spill(self, bucket: int, current: int | None = None) -> int:
        if self.spill_cfg is None or self.sim is None or bucket == current:
            return bucket
        from areal_libra.cmlfq.spill import spill

        return spill(bucket, self._loads(), self.spill_cfg)

    def _req(self, req: SimRequest, context: int):
        tr = req.traj
        return self._info(tr.trajectory_id, tr.prompt_id, tr.prompt_tokens, context,
                          req.gen_before(), tuple(req.tool_state),
                          step=req.start_version)

    def start(self, req: SimRequest) -> int:
        self._count()
        return self._spill(self.policy.start(self._req(req, req.traj.prompt_tokens)))

    def tool_return(self, req: SimRequest) -> int:
        # After a re-plan with fewer buckets, a request may still sit on a bucket index that is gone.
        cur = min(req.bucket, self.n_buckets - 1)
        self._count()
        if self._keeps_bucket:
            return cur  # = self._spill(cur, cur)
        payload = req.tool_state[-1].payload_tokens if req.tool_state else 0
        return self._spill(self.policy.tool_return(self._req(req, req.ctx + payload), cur), cur)

    def finish(self, req: SimRequest) -> None:
        self.policy.finish(req.traj)

    def displaced(self, req: SimRequest) -> int:
        """A request whose server was retired (a reconfiguration, an elastic join) is sent again, as the live
        client resends an aborted request through the router: least-loaded's pick for a policy that keeps
        buckets, else its bucket with load-aware spill-over. Placing it on its old bucket index unrouted piled a
        re-plan's displaced requests onto the new layout's one small server."""
        ctx = req.ctx + req.done_tokens
        if self._keeps_bucket:
            return self.policy.start(self._req(req, ctx))
        # Its bucket (clipped to the layout's), or the one its context has reached if that is further.
        return self._spill(max(min(req.bucket, self.n_buckets - 1), self.policy.bucket_of(ctx)))

    def end_step(self) -> None:
        if hasattr(self.policy, "bucket_gpus") and self.sim is not None:
            gpus = [0.0] * self.n_buckets  # the fallback's placement shares (C-MLFQ's fallback verdict)
            for s in self.sim.servers:
                if s.bucket < self.n_buckets and not s.retired:
                    gpus[s.bucket] += s.tp
            self.policy.bucket_gpus = gpus
        fn = getattr(self.policy, "end_step", None)
        if fn is not None:
            fn()


def policy_router(name: str, **switches) -> Callable[[Layout], Router]:
    def build(layout: Layout) -> Router:
        from areal_libra.cmlfq import make_policy

        return PolicyRouter(make_policy(name, layout.bucket_limits, **switches))

    return build


# ------------------------------------------------------------------ layouts
def homogeneous_servers(gpus: int, tp: int) -> list[tuple[int, int]]:
    return [(tp, 0)] * (gpus // tp)


def best_train_layout(truth: HardwareTruth, gpus: int, seq_lens: list[int]) -> TrainLayout:
    """How a user sets up Megatron for `gpus` GPUs: TP inside a node, DP across, best measured of those."""
    if gpus < 1:
        raise SimError("no GPU left for training")
    best, best_t = None, math.inf
    for tp in (8, 4, 2, 1):
        if tp > gpus or gpus % tp or not truth.train_memory_ok(tp, 1, gpus // tp):
            continue
        t = truth.train_step_s(seq_lens, tp, 1, gpus // tp)
        if t < best_t:
            best, best_t = TrainLayout(tp, 1, gpus // tp), t
    if best is None:
        for pp in (2, 4, 8):
            if gpus % (8 * pp) == 0 and truth.train_memory_ok(8, pp, gpus // (8 * pp)):
                return TrainLayout(8, pp, gpus // (8 * pp))
        raise SimError(f"the model does not fit for training on {gpus} GPUs")
    return best


def min_train_gpus(truth: HardwareTruth) -> int | None:
    """Fewest GPUs one training replica needs (weights, gradients and sharded optimizer must fit)."""
    for g in (1, 2, 4, 8, 16, 32, 64, 128):
        for tp in (1, 2, 4, 8):
            if g % tp == 0 and g // tp <= 16 and truth.train_memory_ok(tp, g // tp, 1):
                return g
    return None


def check_cluster(truth: HardwareTruth, n_gpus: int) -> None:
    """A cluster must hold at least one training replica and one rollout server."""
    min_roll = next((tp for tp in (1, 2, 4, 8) if truth.kv_capacity_tokens(tp) > 0), None)
    min_train = min_train_gpus(truth)
    if min_roll is None or min_train is None:
        raise SimError(f"{truth.model.name} does not fit on {truth.gpu.name} GPUs at up to TP8 / PP16")
    if n_gpus < min_roll + min_train:
        raise SimError(f"cluster of {n_gpus} GPUs is smaller than one model replica for training ({min_train} GPUs) "
                       f"plus one rollout server ({min_roll} GPUs) for {truth.model.name}")


def _profile_lens(env: Env) -> list[int]:
    prof = env.workload.profile(env.profile_groups)
    batch = env.workload.cfg.batch_prompts * max(1, len(prof) // max(1, env.profile_groups))
    lens = [t.final_length for t in prof]
    return (lens * (batch // max(1, len(lens)) + 1))[:batch]


def split_layout(env: Env, rollout_gpus: int, tp: int) -> Layout:
    train = best_train_layout(env.truth, env.n_gpus - rollout_gpus, _profile_lens(env))
    return Layout(train, homogeneous_servers(rollout_gpus, tp), [env.workload.cfg.max_len])


# ------------------------------------------------------------------ baselines
class GreedyController(Controller):
    """verl-Greedy-Heuristic: after the first step, split GPUs in proportion to its measured rollout and
    training times, then keep that split."""

    def __init__(self, env: Env, tp: int):
        self.env, self.tp, self.done = env, tp, False

    def on_step_end(self, sim: Simulation, rec: dict) -> None:
        if self.done:
            return
        self.done = True
        n = self.env.n_gpus
        t_r, t_t = rec["interval_s"], rec["train_s"]
        gpn = self.env.truth.gpu.gpus_per_node
        roll = round(n * t_r / (t_r + t_t) / gpn) * gpn
        roll = min(max(roll, gpn), n - gpn)
        lay = split_layout(self.env, roll, self.tp)
        if lay.train != sim.train_layout or lay.rollout_gpus != sim.layout.rollout_gpus:
            sim.apply_layout(lay, train_changed=lay.train != sim.train_layout)


def verl_colocated(env: Env) -> SystemSpec:
    train = best_train_layout(env.truth, env.n_gpus, _profile_lens(env))
    lay = Layout(train, homogeneous_servers(env.n_gpus, BASELINE_ROLLOUT_TP), [env.workload.cfg.max_len])
    run = RunConfig(max_staleness=0, colocated=True, mem_fraction=0.5)
    return SystemSpec("verl_colocated", lay, run, policy_router("least_loaded"))


def verl_static_uniform(env: Env) -> SystemSpec:
    lay = split_layout(env, env.n_gpus // 2, BASELINE_ROLLOUT_TP)
    return SystemSpec("verl_static_uniform", lay, RunConfig(max_staleness=VERL_STALENESS),
                      policy_router("least_loaded"))


def verl_greedy(env: Env) -> SystemSpec:
    lay = split_layout(env, env.n_gpus // 2, BASELINE_ROLLOUT_TP)
    return SystemSpec("verl_greedy", lay, RunConfig(max_staleness=VERL_STALENESS), policy_router("least_loaded"),
                      GreedyController(env, BASELINE_ROLLOUT_TP))


# AReaL-Static-Optimal's sweep: every candidate runs a stationary replay of the initial workload (its first
# SWEEP_REPLAY steps, drift frozen) and is measured over steps SWEEP_WARMUP..SWEEP_END, after warm-up (the
# first steps fill the staleness window and are faster than the steady state).
SWEEP_REPLAY = 5
SWEEP_WARMUP = 5
SWEEP_END = 20
SWEEP_FORMAT = 1  # bump when what a cached sweep means changes
SWEEP_SEED_OFFSET = 1000  # the sweep's own sample of the workload, not the measured run's
# Source files whose behaviour a cached sweep depends on: a change to any of them starts a new cache entry.
_SWEEP_SOURCES = ("sim/cluster.py", "sim/server.py", "sim/hardware.py", "sim/workloads.py", "sim/systems.py",
                  "trace.py", "elastic/measure.py", "cmlfq/policy.py", "cmlfq/__init__.py", "cmlfq/aging.py")


class StationaryReplay(Workload):
    """The workload as it is on its first `steps` steps, without drift: every group is drawn at a policy
    version chosen uniformly from 0..steps-1, whatever the run's version. A sweep on it never sees later
    steps."""

    def __init__(self, base: Workload, steps: int = SWEEP_REPLAY) -> None:
        super().__init__(base.cfg)
        self.base, self.steps = base, steps
        self.name = getattr(base, "name", "workload")

    def sample_group(self, version: int, rng):
        return self.base.sample_group(rng.randrange(self.steps), rng)


class RecordedReplay(Workload):
    """The first groups a Simulation of a given seed would draw from `replay`, generated once and handed out
    in order (the sweep's candidates all draw the same sequence: the workload generator is its own RNG, and
    a StationaryReplay ignores the version). Past the recording it continues live from the generator's state
    at the end of the recording, so a run sees exactly the groups it would have drawn itself."""

    def __init__(self, replay: StationaryReplay, seed: int, n_groups: int) -> None:
        import copy

        from areal_libra.sim.cluster import workload_rng

        super().__init__(replay.cfg)
        self.name = replay.name
        rng = workload_rng(seed)
        self.state0 = rng.getstate()
        with gc_paused():
            self.groups = [replay.sample_group(0, rng) for _ in range(n_groups)]
        self.state_end = rng.getstate()
        self.live = copy.deepcopy(replay)  # its counters as they are after the recording
        self._i = 0

    def fresh(self) -> RecordedReplay:
        """A reader from the start that shares the recording."""
        import copy

        new = copy.copy(self)
        new.live, new._i = copy.deepcopy(self.live), 0
        return new

    def sample_group(self, version: int, rng):
        i = self._i
        self._i += 1
        if i == 0 and rng.getstate() != self.state0:
            raise SimError("a recorded replay was read with another seed's generator")
        if i < len(self.groups):
            return list(self.groups[i])
        if i == len(self.groups):
            rng.setstate(self.state_end)
        return self.live.sample_group(version, rng)


def static_search_space(n_gpus: int, gpn: int) -> list[int]:
    """Rollout GPU counts tried by the static sweep: multiples of 4 (of 4·ceil(n/48) on clusters larger than
    48 GPUs, so about a dozen counts), leaving at least 4 GPUs for training."""
    step = 4 * max(1, math.ceil(n_gpus / 48))
    return list(range(step, n_gpus - 3, step)) or [n_gpus // 2]


def sweep_candidates(env: Env) -> list[tuple[int, int]]:
    """(rollout GPUs, TP) of every static layout the sweep measures: TP 1/2/4/8 dividing the rollout GPUs,
    with KV room for the longest request."""
    out = []
    for roll in static_search_space(env.n_gpus, env.truth.gpu.gpus_per_node):
        for tp in (1, 2, 4, 8):
            if roll % tp or tp > env.truth.gpu.gpus_per_node:
                continue
            if env.truth.kv_capacity_tokens(tp) < env.workload.cfg.max_len:
                continue
            out.append((roll, tp))
    return out


def steady_tokens_per_s(records: list[dict], warmup: int = SWEEP_WARMUP, end: int = SWEEP_END) -> float:
    """Model tokens per second over steps warmup..end (inclusive) of a run's step records."""
    recs = {r["step"]: r for r in records}
    if end not in recs:
        raise SimError(f"the run ended before step {end}")
    t0 = recs[warmup - 1]["t_end"] if warmup > 0 else 0.0
    toks = sum(recs[k]["tokens"] for k in range(warmup, end + 1))
    return toks / max(1e-9, recs[end]["t_end"] - t0)


def _train_desc(t: TrainLayout) -> dict:
    return {"gpus": t.gpus, "tp": t.tp, "pp": t.pp, "dp": t.dp}


def run_candidate(env: Env, roll: int, tp: int, recorded: RecordedReplay | None = None,
                  run: RunConfig | None = None) -> Simulation | None:
    """Simulate one static layout on the stationary replay through the sweep's window; None when the layout
    does not fit (no training layout for the remaining GPUs). `recorded`: the replay's groups drawn once for
    every candidate (same results, less time). `run`: the loop it runs under (default AReaL's)."""
    import copy

    try:
        lay = split_layout(env, roll, tp)
    except SimError:
        return None
    # A private copy: the sweep must not advance the workload's own counters the measured runs use.
    wl = recorded.fresh() if recorded is not None else StationaryReplay(copy.deepcopy(env.workload))
    sim = Simulation(env.truth, wl, env.n_gpus, lay, run or areal_run_config(env),
                     policy_router("least_loaded")(lay), seed=env.seed + SWEEP_SEED_OFFSET)
    sim.run(SWEEP_END + 1)
    return sim


def measure_candidate(env: Env, roll: int, tp: int, recorded: RecordedReplay | None = None,
                      run: RunConfig | None = None) -> dict | None:
    """One static layout's steady throughput on the stationary replay (run_candidate); None when it does not
    fit."""
    sim = run_candidate(env, roll, tp, recorded, run)
    if sim is None:
        return None
    return {"rollout_gpus": roll, "tp": tp, "train": _train_desc(sim.layout.train),
            "tokens_per_s": steady_tokens_per_s(sim.records)}


def default_cache_root() -> Path:
    """$AREAL_LIBRA_CACHE, else ~/.cache/areal_libra (shared with the model cache)."""
    env = os.environ.get("AREAL_LIBRA_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "areal_libra"


def _workload_digest(wl: Workload) -> str:
    """What the sweep sees of the workload: its config and a sample of its first steps (covers trace files)."""
    import copy
    import random as _random

    w = copy.deepcopy(wl)
    rows = []
    for v in range(SWEEP_REPLAY):
        for t in w.sample_group(v, _random.Random(v)):
            rows.append((t.prompt_tokens, [(s.gen_tokens, s.tool.payload_tokens if s.tool else 0,
                                            round(s.tool.latency_s, 6) if s.tool else 0) for s in t.segments]))
    blob = json.dumps([type(wl).__name__, getattr(wl, "name", ""), asdict(wl.cfg), rows], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def sweep_key(env: Env, run: RunConfig | None = None) -> dict:
    """Everything a cached sweep depends on: workload (config, initial sample), cluster and model (the
    truth's spec sheets and constants), scale, staleness, seed, the loop the candidates run under (`run`,
    default AReaL's), the sweep's window and the simulator's code."""
    root = Path(__file__).resolve().parents[1]
    code = hashlib.sha256()
    for rel in _SWEEP_SOURCES:
        f = root / rel
        code.update(rel.encode() + (f.read_bytes() if f.is_file() else b""))
    truth = env.truth
    return {"format": SWEEP_FORMAT, "workload": getattr(env.workload, "name", "workload"),
            "workload_digest": _workload_digest(env.workload), "n_gpus": env.n_gpus,
            "batch_prompts": env.workload.cfg.batch_prompts, "group_size": env.workload.cfg.group_size,
            "truth": repr((truth.gpu, truth.model, truth.c)), "staleness": env.staleness, "seed": env.seed,
            "max_concurrent_groups": env.max_concurrent_groups, "run": repr(run or areal_run_config(env)),
            "window": [SWEEP_REPLAY, SWEEP_WARMUP, SWEEP_END, SWEEP_SEED_OFFSET], "code": code.hexdigest()}


def sweep_cache_path(env: Env, key: dict | None = None) -> Path:
    key = key or sweep_key(env)
    h = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", str(key["workload"]))[:40]
    return default_cache_root() / "static_sweep" / f"{name}-{env.n_gpus}gpus-seed{env.seed}-{h}.json"


# The environment, recorded replay and loop forked sweep workers measure with (inherited, not pickled).
_SWEEP_ENV: tuple[Env, RecordedReplay, RunConfig | None] | None = None


def _measure_indexed(args: tuple[int, int, int]) -> tuple[int, dict | None]:
    i, roll, tp = args
    assert _SWEEP_ENV is not None
    env, recorded, run = _SWEEP_ENV
    return i, measure_candidate(env, roll, tp, recorded, run)


def sweep_jobs() -> int:
    """Parallel sweep processes: $AREAL_LIBRA_SWEEP_JOBS, else one per CPU (at most 8); 1 inside a worker
    process (the regime map already runs points in parallel)."""
    import multiprocessing as mp

    if mp.parent_process() is not None:
        return 1
    raw = os.environ.get("AREAL_LIBRA_SWEEP_JOBS")
    if raw:
        try:
            return max(1, int(raw))
        except ValueError:
            raise SimError(f"AREAL_LIBRA_SWEEP_JOBS must be an integer, got {raw!r}") from None
    return max(1, min(8, os.cpu_count() or 1))


def cached_sweep(env: Env, key: dict | None = None) -> list[dict] | None:
    """The cached sweep's candidates for this run (static_sweep's cache entry), or None: none, unreadable, or
    written for other inputs (an unreadable entry is measured again and overwritten by static_sweep)."""
    key = key or sweep_key(env)
    try:
        data = json.loads(sweep_cache_path(env, key).read_text())
        if isinstance(data, dict) and data.get("key") == key:
            return data["candidates"]
    except (OSError, ValueError, KeyError):
        pass
    return None


def static_sweep(env: Env, jobs: int | None = None, log: Callable[[str], None] | None = None,
                 use_cache: bool = True, run: RunConfig | None = None,
                 label: str = "AReaL-Static-Optimal") -> list[dict]:
    """Measure every candidate static layout (sweep_candidates) on the stationary replay of the initial
    workload, under the loop `run` (default AReaL's); cached per workload, cluster, scale, seed and loop as an
    atomic JSON file under the cache root. Progress goes to `log` (default: stderr), each line headed by
    `label`, once the sweep has run for more than 10 s."""
    global _SWEEP_ENV
    key = sweep_key(env, run)
    path = sweep_cache_path(env, key)
    if use_cache:
        cached = cached_sweep(env, key)
        if cached is not None:
            return cached
    cands = sweep_candidates(env)
    jobs = sweep_jobs() if jobs is None else max(1, jobs)
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    t0 = time.time()
    results: dict[int, dict | None] = {}

    def done(i: int, r: dict | None) -> None:
        results[i] = r
        if time.time() - t0 > 10:
            what = f"{r['rollout_gpus']} rollout GPUs TP{r['tp']}: {r['tokens_per_s']:.0f} tokens/s" if r else "skipped"
            log(f"{label} sweep [{len(results)}/{len(cands)}] {what} ({time.time() - t0:.0f} s)")

    import copy

    # Every candidate draws the same groups: generate them once (a run takes about SWEEP_END + eta + 2 batches).
    n_groups = (SWEEP_END + env.staleness + 3) * env.workload.cfg.batch_prompts
    recorded = RecordedReplay(StationaryReplay(copy.deepcopy(env.workload)), env.seed + SWEEP_SEED_OFFSET, n_groups)
    todo = [(i, roll, tp) for i, (roll, tp) in enumerate(cands)]
    if jobs <= 1 or len(todo) <= 1:
        for i, roll, tp in todo:
            done(i, measure_candidate(env, roll, tp, recorded, run))
    else:
        import multiprocessing as mp

        _SWEEP_ENV = (env, recorded, run)
        try:
            with mp.get_context("fork").Pool(min(jobs, len(todo))) as pool:
                for i, r in pool.imap_unordered(_measure_indexed, todo):
                    done(i, r)
        finally:
            _SWEEP_ENV = None
    out = [results[i] for i in sorted(results) if results[i] is not None]
    if not out:
        raise SimError("no static layout fits this cluster")
    if use_cache:
        from areal_libra.utils import atomic_write_text

        try:
            atomic_write_text(path, json.dumps({"key": key, "candidates": out}, indent=1))
        except OSError as e:  # a read-only cache only costs the next run a sweep
            log(f"warning: cannot cache the static sweep at {path}: {e}")
    return out


def areal_static_optimal(env: Env) -> SystemSpec:
    """AReaL with the best static split and homogeneous TP, as a user's tuning sweep finds it on the initial
    workload: every candidate of `sweep_candidates` measured after warm-up on a stationary replay of the
    workload's first steps (static_sweep); the training layout for the remaining GPUs is the best measured
    Megatron layout (best_train_layout, token-balanced: DP need not divide the batch)."""
    return best_static("areal_static_optimal", env, areal_run_config(env), "baseline")


def best_static(name: str, env: Env, run: RunConfig, report: str, label: str = "AReaL-Static-Optimal") -> SystemSpec:
    """The best candidate of the sweep under the loop `run` (static_sweep), run under that loop with
    least-loaded routing; the sweep is reported as `<report>_candidates` and `<report>_choice`."""
    cands = static_sweep(env, run=run, label=label)
    best = max(cands, key=lambda c: c["tokens_per_s"])  # first of equals: candidate order
    lay = split_layout(env, best["rollout_gpus"], best["tp"])
    extra = {f"{report}_candidates": cands,
             f"{report}_choice": {"rollout_gpus": best["rollout_gpus"], "tp": best["tp"], "train": best["train"],
                                  "sweep_tokens_per_s": best["tokens_per_s"]}}
    return SystemSpec(name, lay, run, policy_router("least_loaded"), extra=extra)


__all__ = ["Env", "SystemSpec", "SYSTEMS", "LADDER", "PolicyRouter", "replace"]
