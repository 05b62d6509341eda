"""The systems the simulator compares: baselines users would pick, Libra, and Libra's ablation ladder.

Each system is a layout (training topology + rollout servers), a run mode (synchronous / colocated /
staleness-bounded asynchronous), a routing policy (from areal_libra.cmlfq) and a controller that
sees only what a live system sees after each step (finished trajectories, measured times) and may
reconfigure: the Global Resource Planner and its re-plan gate (areal_libra.planner), the elastic pool
policy (areal_libra.elastic). Nothing here re-implements those algorithms; it only wires them up.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from areal_libra.sim.cluster import Controller, Layout, Router, RunConfig, SimError, Simulation, TrainLayout
from areal_libra.sim.hardware import HardwareTruth
from areal_libra.sim.server import SimRequest
from areal_libra.sim.workloads import Workload

SYSTEMS = ("verl_colocated", "verl_static_uniform", "verl_greedy", "areal_static_optimal", "libra")
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
    profile_groups: int = 16
    knobs: SimKnobs = field(default_factory=SimKnobs)
    staleness: int = AREAL_STALENESS  # eta of AReaL-Static-Optimal and Libra (the regime map sweeps it)


@dataclass
class SystemSpec:
    name: str
    layout: Layout
    run: RunConfig
    router_factory: Callable[[Layout], Router]
    controller: Controller = field(default_factory=Controller)


# ------------------------------------------------------------------ routing adapters
class PolicyRouter(Router):
    """Feeds the simulator's requests to an areal_libra.cmlfq routing policy."""

    def __init__(self, policy, spill_cfg=None):
        self.policy = policy
        self.n_buckets = len(policy.buckets)
        from areal_libra.cmlfq import RequestInfo

        self._info = RequestInfo
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
                          sum(s.gen_tokens for s in tr.segments[: req.seg]), tuple(req.tool_state),
                          step=req.start_version)

    def start(self, req: SimRequest) -> int:
        self._count()
        return self._spill(self.policy.start(self._req(req, req.traj.prompt_tokens)))

    def tool_return(self, req: SimRequest) -> int:
        payload = req.tool_state[-1].payload_tokens if req.tool_state else 0
        # After a re-plan with fewer buckets, a request may still sit on a bucket index that is gone.
        cur = min(req.bucket, self.n_buckets - 1)
        self._count()
        return self._spill(self.policy.tool_return(self._req(req, req.ctx + payload), cur), cur)

    def finish(self, req: SimRequest) -> None:
        self.policy.finish(req.traj)

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


def static_search_space(n_gpus: int, gpn: int) -> list[int]:
    """Rollout GPU counts tried by the static search: multiples of a node, at most ~8 candidates."""
    nodes = n_gpus // gpn
    step = max(1, nodes // 8)
    return [k * gpn for k in range(step, nodes, step)] or [n_gpus // 2]


def areal_static_optimal(env: Env, search_steps: int = 3) -> SystemSpec:
    """AReaL with the best static split and homogeneous TP, found by simulating the first steps of every
    candidate on the initial workload (what a user's tuning sweep would measure)."""
    best, best_tps = None, -1.0
    gpn = env.truth.gpu.gpus_per_node
    for roll in static_search_space(env.n_gpus, gpn):
        for tp in (1, 2, 4, 8):
            if roll % tp or env.truth.kv_capacity_tokens(tp) < env.workload.cfg.max_len:
                continue
            try:
                lay = split_layout(env, roll, tp)
            except SimError:
                continue
            sim = Simulation(env.truth, env.workload, env.n_gpus, lay, RunConfig(max_staleness=env.staleness),
                             policy_router("least_loaded")(lay), seed=env.seed + 1000)
            res = sim.run(search_steps)
            if res["tokens_per_s"] > best_tps:
                best, best_tps = lay, res["tokens_per_s"]
    if best is None:
        raise SimError("no static layout fits this cluster")
    return SystemSpec("areal_static_optimal", best, RunConfig(max_staleness=env.staleness),
                      policy_router("least_loaded"))


def static_uniform_async(env: Env) -> SystemSpec:
    """Ladder rung 0: AReaL-style asynchrony (as Libra) with a half/half split and homogeneous TP."""
    lay = split_layout(env, env.n_gpus // 2, BASELINE_ROLLOUT_TP)
    return SystemSpec("static_uniform", lay, RunConfig(max_staleness=AREAL_STALENESS), policy_router("least_loaded"))


__all__ = ["Env", "SystemSpec", "SYSTEMS", "LADDER", "PolicyRouter", "replace"]
