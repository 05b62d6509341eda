"""Libra and its ablation ladder in the simulator: the Global Resource Planner (areal_libra.planner) picks
the split and the rollout server mix from the length history, its re-plan gate decides reconfigurations,
C-MLFQ (areal_libra.cmlfq) routes between TP buckets, and the elastic pool policy
(areal_libra.elastic) moves whole data-parallel replicas between training and rollout.

The controller sees only what the live system sees: (prompt_tokens, final_length) of finished
trajectories, measured step/rollout/training times and server pressure.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from areal_libra.cmlfq import aging
from areal_libra.control import ControlConfig, LibraController, PoolView, ProfilePass, StepObservation
from areal_libra.control.cohorts import CohortHistory
from areal_libra.control.prediction import RankingProbe, layout_plan
from areal_libra.control.profile import length_history, train_batch_lens
from areal_libra.cost.training import TrainParallel
from areal_libra.elastic.policy import LEND_IN_FILL, hybrid_count, hybrid_server_tp
from areal_libra.planner.replan import ReplanConfig
from areal_libra.sim.cluster import Controller, Layout, Router, RunConfig, SimError, Simulation, TrainLayout
from areal_libra.sim.systems import (
    AREAL_STALENESS,
    BASELINE_ROLLOUT_TP,
    Env,
    PolicyRouter,
    SimKnobs,
    SystemSpec,
    areal_run_config,
    best_static,
    cached_sweep,
    policy_router,
    split_layout,
    sweep_key,
)


@dataclass
class LibraOptions:
    """What a rung of the ladder has; the controller's settings are ControlConfig's (control_config)."""

    homogeneous: bool = False  # +planner: a single rollout TP (the planner's best homogeneous plan)
    # A rung without C-MLFQ routes least-loaded, length-blind (_router_for), so it plans one TP as well
    # (PlannerConfig.routing): +hetero_tp plans as +planner.
    cmlfq: bool = True
    elastic: bool = True
    hybrid_replicas: int = 3  # Elastic Hybrid Pool workers carved from the planned rollout pool


# What one reconfiguration costs in the re-plan gate on the simulated 48-GPU production cluster (a live CPU
# run uses ReplanConfig's own default): this context's setting of the one field, ReplanConfig.reconfig_cost_s.
SIM_RECONFIG_COST_S = 120.0


TREE_BACKEND = "auto"  # the scheduler's C++ prefix tree when built, else its Python core
# A request whose context already overruns its bucket follows the mean when mean and P90 disagree. The
# knob cmlfq_mode=auto runs C-MLFQ's auto mode instead (the live default, cmlfq/auto.py): the simulator's
# published figures were measured with these fixed switches.
CMLFQ_SWITCHES: dict = {"overrun": True}


def _spill_cfg(knobs: SimKnobs):
    """Load-aware spill-over between neighbouring buckets on C-MLFQ's placements (areal_libra.cmlfq.spill;
    the live Dispatcher's `spill` switch); None when the knob turns it off."""
    if knobs.spill_ratio is None:
        return None
    from areal_libra.cmlfq.spill import SpillConfig

    return SpillConfig(ratio=knobs.spill_ratio)

RUNGS = {
    "+planner": LibraOptions(homogeneous=True, cmlfq=False, elastic=False),
    "+hetero_tp": LibraOptions(cmlfq=False, elastic=False),
    "+cmlfq": LibraOptions(elastic=False),
    "+elastic": LibraOptions(),
    "libra": LibraOptions(),
}


def _planner():
    try:
        from areal_libra.planner import PlanError, PlannerConfig, solve
    except ImportError as e:  # the planner is another issue's code; say exactly what is missing
        raise SimError(f"Libra needs areal_libra.planner ({e})") from None
    return solve, PlannerConfig, PlanError


CALIBRATE = True
# The controller's online per-term calibration and the calibrated re-plan gate (areal_libra.control.calibration).
# On since the gate refuses a plan that takes GPUs from a side beyond what that side measurably used
# (LibraController._capacity_ok): before, with one scalar rollout factor whose fitted value depends on the TP
# mix in force (0.85-1.57 on DAPO-Math across the layouts it tried), every periodic decision moved to another
# layout and R2E-Gym lost 16-24% (docs/pricing.md); now the three workloads keep their plans (issue 23) and the
# 4x growth trace moves GPUs to training. The live and simulated controllers run it when on.
CALIBRATE_ONLINE = True
# Libra bounds every trained trajectory's version lag by eta at consumption (RunConfig.strict_staleness: the
# trainer waits for a group that would otherwise be trained more than eta versions after it started,
# cmlfq.aging.select_batch), and its rollout servers serve the oldest start version first (RunConfig.edf,
# areal_libra.cmlfq.aging), so such a group's requests are not queued behind newer ones. AReaL-Static-Optimal
# keeps AReaL's rule (issue 23). The live run does the same when LibraConfig.bound_lag is on (patches 14 and
# 15, areal_libra.live.lag_bound, the router's request priority, aging.SGLANG_FLAGS). One switch:
# aging.BOUND_LAG, on: at the paper's scale (128x16, 60 steps, seeds 0-2) Libra is 1.00-1.06x on Search-R1 and
# DAPO-Math, 1.39-1.42x on R2E-Gym with max lag 4. Its cost is the trainer's waits for stragglers where the tail
# spans more than eta steps: at 16x16 (seed 3) 0.74 / 0.95 / 0.79x against 0.94 / 0.95 / 0.98x off; 64 x H200
# with 64x16 Search-R1 0.77x against 1.00x off (docs/simulator.md).
BOUND_LAG = aging.BOUND_LAG
WORKING_SET = aging.WORKING_SET_ADMISSION
# Plan for the in-flight window of an asynchronous run: with staleness bound eta, eta+1 batches are in
# flight, so the planner sizes both sides for (eta+1) batches; the long tail is then paid once per window
# instead of once per step, as it is in the running system.
PLAN_WINDOW = AREAL_STALENESS + 1
# "async": the planner prices rollout as AReaL's staleness-bounded loop does it (PlannerConfig mode="async",
# staleness=eta: sustained throughput of eta+1 batches in flight, the tail only has to finish within the
# window, each weight update re-prefilling the resident requests) for one batch per step. "window": a
# synchronous plan for PLAN_WINDOW batches at once (the previous default; it sizes training for 5 batches,
# so its micro-batch and bubble figures are not the step's). "async" (SimKnobs.planner_mode) is the default
# since the planner models the re-prefill after each weight update (docs/simulator.md).


def trajectories_per_step(env: Env) -> int:
    """The workload's batch in trajectories: batch_prompts groups x group_size members."""
    return env.workload.cfg.batch_prompts * env.workload.cfg.group_size


def planner_config(env: Env, **fields):
    """The PlannerConfig the simulated Libra plans with (global batch and rollout mode per the planner_mode
    knob)."""
    _, PlannerConfig, _ = _planner()
    per_step = trajectories_per_step(env)
    if env.knobs.planner_mode == "async":
        fields.setdefault("length_biased_kv", LENGTH_BIASED_KV)
        return PlannerConfig(global_batch=per_step, mode="async", staleness=env.staleness, **fields)
    return PlannerConfig(global_batch=per_step * (env.staleness + 1), **fields)


# The profiling pass also times one training step of the run's own batch (the first profile's lengths tiled
# to the global batch) per single-node layout, and the planner's training efficiency is fitted to it
# (sim/calib.py). Without it the training term is the preset's: at 128 x 16 it priced the steady batch's
# training 1.10-1.17x above what the trainer then measured (the Cost Evaluator recomputes activations, the
# trainer here does not), so every first plan gave training 4-8 GPUs too many (docs/pricing.md).
PROFILE_TRAIN = True


def train_profile_lens(env: Env, trajs) -> tuple[int, ...] | None:
    """One global batch of the profile's final lengths (the batch a user times a training step on)."""
    if not PROFILE_TRAIN:
        return None
    return train_batch_lens(trajs, trajectories_per_step(env))


def planner_cluster(env: Env):
    """The cluster spec the planner plans on: the preset, with efficiency factors fitted to a profiling pass
    (areal_libra.cost.calibrate) when CALIBRATE is on (training too, on the run's batch, once libra_system
    has set the first profile's lengths)."""
    if env.cluster is None:
        return f"{env.truth.gpu.name}x{env.n_gpus}"
    if not CALIBRATE:
        return env.cluster
    cached = getattr(env, "_calibrated", None)
    if cached is None:
        from areal_libra.sim.calib import calibrated_hardware

        hw, err = calibrated_hardware(env.truth, env.cluster.hardware, env.model, env.seed,
                                      train_lens=getattr(env, "_train_profile_lens", None))
        cached = replace(env.cluster, hardware=hw)
        env._calibrated = cached
        env.calibration_error = err
    return cached


# Price the asynchronous loop's in-flight slots (areal_libra.planner.slots: a group holds its slots for its
# longest member's decode and tool waits, E over finished groups; Little's law over the eta + 1 batches in
# flight) instead of the critical path of the history's single longest request. Off: measured at 60 steps,
# seed 0, it gains on Search-R1 (12,271 -> 12,792) and loses on R2E-Gym (4,110 -> 3,983) with the
# length-biased KV below (docs/pricing.md); kept in the code for the calibrated planner.
SLOT_PRICING = False
# A running request's resident KV priced length-biased (PlannerConfig.length_biased_kv, its default): on
# DAPO-Math the first plan moves from 22 rollout GPUs to 3xTP8 (16,650 -> 18,830 tokens/s).
LENGTH_BIASED_KV = True


def traj_tool_wait_s(env: Env, tr, run_scale: float = 1.0) -> float:
    """The tool waits of a finished trajectory as the loop measured them: each call's wall time in this
    simulation (the workload's latency at the run's and the cluster's tool speed)."""
    scale = run_scale * env.truth.c.tool_latency_scale
    return sum(s.tool.latency_s for s in tr.segments if s.tool is not None) * scale


def traj_tool_returns(tr) -> int:
    """Tool calls of a finished trajectory whose result the model read (a generation segment follows)."""
    return sum(1 for s in tr.segments[:-1] if s.tool is not None)


def traj_gen_tokens(tr) -> int:
    """Generated tokens as the planner's history counts them (HISTORY_TRIPLES: model tokens only)."""
    return tr.model_tokens if HISTORY_TRIPLES else tr.final_length - tr.prompt_tokens


def group_slot_fields(env: Env, trajs, group_size: int, run_scale: float = 1.0) -> dict:
    """PlannerConfig's slot fields from finished trajectories: complete groups (same prompt and policy
    version, `group_size` members) only; {} when SLOT_PRICING is off or no group is complete."""
    if not SLOT_PRICING:
        return {}
    from areal_libra.planner.slots import slot_stats

    groups: dict = {}
    for tr in trajs:
        groups.setdefault((tr.prompt_id, tr.step), []).append(tr)
    done = [[(traj_gen_tokens(t), traj_tool_wait_s(env, t, run_scale)) for t in g]
            for g in groups.values() if len(g) >= group_size]
    out, wait = slot_stats(done)
    return {} if out is None else {"slot_output": out, "slot_wait_s": wait}


def plan_for(env: Env, history, homogeneous: bool, factors=None, **restrict):
    """Call the planner; homogeneous: the best single-TP plan by the planner's own prediction (PlannerConfig.routing
    "blind"). `restrict` passes PlannerConfig fields (used to price the current layout on a new history)."""
    solve, _, _ = _planner()
    cluster = planner_cluster(env)
    model = env.model if env.model is not None else env.truth.model.name
    tps = restrict.pop("allowed_tp", (1, 2, 4, 8))
    if factors is not None:  # the controller's online calibration (areal_libra.control.calibration)
        restrict.update(train_factor=factors.train, rollout_factor=factors.rollout)
    if homogeneous:
        restrict["routing"] = "blind"
    return solve(cluster, model, history, planner_config(env, allowed_tp=tuple(tps), **restrict))


# Give the planner (prompt, final, model_tokens) triples (tool payloads prefilled, only model tokens
# decoded) or plain (prompt, final) pairs. Off: measured (docs/pricing.md), triples move R2E-Gym's first
# plan to TP2xDP12 + 4xTP4 + 1xTP8 (4,110 -> 4,086 tokens/s) and change nothing on the other two.
HISTORY_TRIPLES = False


# The first plan's profile: the groups of this many training steps of the initial policy (at least
# env.profile_groups), with their whole tail; 0 keeps env.profile_groups. Off: a profile of 3 or 5 steps
# holds R2E-Gym's 40,960-token trajectories, for which the planner's memory model rules out TP2 training
# (R2E-Gym 4,110 -> 3,284, Search-R1 12,271 -> 11,619; docs/pricing.md).
PROFILE_STEPS = 0


def profile_groups(env: Env) -> int:
    return max(env.profile_groups, PROFILE_STEPS * env.workload.cfg.batch_prompts)


def profile_history(trajs) -> list[tuple[int, ...]]:
    """The planner's length history from finished trajectories (see HISTORY_TRIPLES)."""
    return length_history(trajs, HISTORY_TRIPLES)


def history_of(sim: Simulation, n: int) -> list[tuple[int, ...]]:
    rows = list(sim.finished)[-n:]
    return rows if HISTORY_TRIPLES else [r[:2] for r in rows]


# Re-plan on complete cohorts only: the finished trajectories of the policy versions none of whose groups is
# still running (every group started before the oldest running one has finished, its whole tail included),
# not the last n to finish. The last to finish are completion-ordered: at step 2 of a 128 x 16 run they were
# the batch's short trajectories (the long ones of version 0 were still decoding), the planner re-solved on
# them and moved GPUs from the starved rollout side to training (R2E-Gym: "measured 859 s -> predicted
# 204 s"; DAPO-Math back to 20 rollout GPUs). None complete yet: no history, so no re-plan.
COMPLETE_COHORTS = True


class SimCohorts:
    """The simulator's adapter of the shared complete-cohort history (control.cohorts.CohortHistory): every
    finished trajectory by the policy version its group started at, and the oldest running group's version
    from the simulation's pending groups."""

    def __init__(self) -> None:
        self.cohorts = CohortHistory()
        self.seen = 0  # finished trajectories ingested (Simulation.traj_durations counts them all)

    @property
    def by_version(self) -> dict[int, list[tuple[int, ...]]]:
        return self.cohorts.by_version

    def ingest(self, sim: Simulation) -> None:
        total = len(sim.traj_durations)
        new = min(total - self.seen, len(sim.finished_trajs))
        if new > 0:
            trajs, rows = list(sim.finished_trajs)[-new:], list(sim.finished)[-new:]
            for tr, row in zip(trajs, rows):
                self.cohorts.add(tr.step, row if HISTORY_TRIPLES else row[:2])
        self.seen = total

    def history(self, sim: Simulation, n: int) -> list[tuple[int, ...]]:
        self.ingest(sim)
        running = [g.version for g in sim.pending if not g.ready]
        return self.cohorts.history(n, min(running) if running else sim.version + 1)


def layout_from_plan(plan, max_len: int, plan_micro_batch: bool = True) -> Layout:
    """Servers and routing buckets of a plan. Bucket thresholds come from Plan.buckets(); the last one takes
    everything up to the model's max length; groups that end at the same threshold share a bucket.
    plan_micro_batch off: the simulated trainer's default of at most 4·PP micro-batches (which the planner
    does not know) instead of the plan's micro-batch size."""
    limits = sorted({lim for lim, _ in plan.buckets()})
    limits[-1] = max(limits[-1], max_len)
    servers = []
    for inst in plan.instances:
        b = next((i for i, lim in enumerate(limits) if inst.max_len <= lim), len(limits) - 1)
        servers += [(inst.tp, b)] * inst.count
    t = plan.train
    # The trainer runs the planner's micro-batch size, as Libra configures Megatron with it.
    return Layout(TrainLayout(t.tp, t.pp, t.dp, t.micro_batch if plan_micro_batch else 0), servers, limits)


class BucketLoadRouter(PolicyRouter):
    """least_loaded across TP buckets, fed with the simulator's per-bucket load per GPU (the live
    Dispatcher plugs its server-group load into the same policy the same way)."""

    def __init__(self, limits):
        from areal_libra.cmlfq import make_policy

        self.sim: Simulation | None = None
        super().__init__(make_policy("least_loaded", limits, load_fn=self._loads))
        self.limits = limits

    def bind(self, sim: Simulation) -> None:
        self.sim = sim

    def _loads(self) -> list[float]:
        n = len(self.limits)
        load, gpus = [0.0] * n, [0.0] * n
        for s in self.sim.servers if self.sim is not None else ():
            if s.bucket < n:
                load[s.bucket] += s.load()
                gpus[s.bucket] += s.tp
        return [x / max(1.0, g) for x, g in zip(load, gpus)]


@dataclass
class HybridUnit:
    """One Elastic Hybrid Pool worker: GPUs for exactly one training data-parallel replica (tp*pp), which
    serve rollout as `specs` servers while not training."""

    specs: list[tuple[int, int]]
    servers: list = field(default_factory=list)
    training: bool = False


def carve_hybrid(layout: Layout, max_units: int, keep_frac: float = 0.5) -> tuple[Layout, list[HybridUnit]]:
    """Move up to `max_units` workers of one training replica's size (tp*pp GPUs) from the core rollout pool
    into the Elastic Hybrid Pool, keeping at least `keep_frac` of the rollout GPUs in the core. GPUs are
    taken from the bucket holding the most GPUs; in rollout mode a worker serves that bucket with servers
    of its TP (TP1 servers fill a remainder)."""
    unit = layout.train.tp * layout.train.pp
    core = list(layout.servers)
    units: list[HybridUnit] = []
    budget = int(layout.rollout_gpus * (1 - keep_frac))
    while len(units) < max_units and budget >= unit:
        per_bucket: dict[int, int] = {}
        for tp, b in core:
            per_bucket[b] = per_bucket.get(b, 0) + tp
        b = max(per_bucket, key=lambda k: (per_bucket[k], k))
        if per_bucket[b] <= unit:
            break  # taking a worker would empty the bucket
        tp_b = max(tp for tp, bb in core if bb == b)
        # Remove `unit` GPUs of bucket b from the core, largest servers first; give back any surplus as TP1.
        taken = 0
        for spec in sorted([c for c in core if c[1] == b], reverse=True):
            if taken >= unit:
                break
            core.remove(spec)
            taken += spec[0]
        core += [(1, b)] * (taken - unit)
        tp_u = 1 << (min(tp_b, unit).bit_length() - 1)  # a power of two that fits the worker
        specs = [(tp_u, b)] * (unit // tp_u) + [(1, b)] * (unit % tp_u)
        units.append(HybridUnit(specs))
        budget -= unit
    return Layout(layout.train, core, layout.bucket_limits), units


def hybrid_from_train(layout: Layout, max_units: int, dp_div: int = 2) -> tuple[Layout, list[HybridUnit]]:
    """Designate up to `max_units` of the plan's training data-parallel replicas (never the last one) as
    Elastic Hybrid Pool workers; they start training and, when released, serve the bucket that holds the
    most rollout GPUs with servers of its TP. At most (dp - 1) // dp_div replicas are elastic: with 2 the
    core keeps more than half of the replicas, so one release never halves the trainer (which made the pool
    swing between release and join every few steps when the plan had DP 2)."""
    t = layout.train
    unit = t.tp * t.pp
    n = hybrid_count(t.dp, max_units, dp_div)
    if n <= 0 or not layout.servers:
        return layout, []
    per_bucket: dict[int, int] = {}
    for tp, b in layout.servers:
        per_bucket[b] = per_bucket.get(b, 0) + tp
    b = max(per_bucket, key=lambda k: (per_bucket[k], k))
    tp_b = max(tp for tp, bb in layout.servers if bb == b)
    tp_u = hybrid_server_tp(unit, tp_b)
    specs = [(tp_u, b)] * (unit // tp_u) + [(1, b)] * (unit % tp_u)
    return layout, [HybridUnit(list(specs), training=True) for _ in range(n)]


# Where the Elastic Hybrid Pool's workers come from: "rollout" (carved out of the planned rollout pool,
# starting as rollout servers) or "train" (the plan's extra training replicas, starting in training).
HYBRID_FROM = "train"


def make_hybrid(layout: Layout, max_units: int, dp_div: int = 2) -> tuple[Layout, list[HybridUnit]]:
    if HYBRID_FROM == "train":
        return hybrid_from_train(layout, max_units, dp_div)
    return carve_hybrid(layout, max_units)


def lend_in_fill(core: Layout, units: list[HybridUnit]) -> Layout:
    """The first plan's pool lent to rollout for the fill: its training units start serving, and the trainer's
    data-parallel size leaves them out until they join (SimCluster.end_fill)."""
    lent = [u for u in units if u.training]
    for u in lent:
        u.training = False
    t = core.train
    return Layout(TrainLayout(t.tp, t.pp, t.dp - len(lent), t.micro_batch), core.servers, core.bucket_limits)


class SimPlanSource:
    """The planner bound to the simulated cluster's spec (areal_libra.control.PlanSource)."""

    def __init__(self, env: Env, homogeneous: bool, slots=None, returns=None) -> None:
        self.env, self.homogeneous = env, homogeneous
        self.slots = slots or (lambda: {})  # the slot fields of the finished groups (group_slot_fields)
        self.returns = returns or (lambda: 0.0)  # tool returns per finished trajectory (SimCluster.tool_returns)

    def solve(self, history):
        return plan_for(self.env, history, self.homogeneous, **self.slots())

    def solve_calibrated(self, history, factors):
        return plan_for(self.env, history, self.homogeneous, factors, **self.slots())

    def price(self, plan, history) -> float:
        t_train, t_roll, _ = self.price_terms(plan, history)
        return max(t_train, t_roll)

    def price_terms(self, plan, history, **loop) -> tuple[float, float, float]:
        """`loop`: planner config fields of another loop than Libra's (RankingProbe.loop); a loop without
        working-set admission is priced with the finished trajectories' tool returns."""
        from areal_libra.planner.evaluate import price_terms

        if loop.get("admission") == "unbounded":
            loop.setdefault("tool_returns", self.returns())
        return price_terms(plan, planner_cluster(self.env), self.env.model or self.env.truth.model.name, history,
                           planner_config(self.env, **self.slots(), **loop))


class SimCluster:
    """The simulated cluster behind the shared LibraController (areal_libra.control.Cluster)."""

    def __init__(self, env: Env, opts: LibraOptions, units: list[HybridUnit]) -> None:
        self.env, self.opts, self.units = env, opts, units
        self.sim: Simulation | None = None
        self.cohorts = SimCohorts()
        self._fill_ended = False

    def attach(self, sim: Simulation) -> None:
        self.sim = sim
        self._bind_units()

    def _layout(self, plan) -> Layout:
        return layout_from_plan(plan, self.env.workload.cfg.max_len, self.env.knobs.train_micro_batch)

    def _bind_units(self) -> None:
        """Units that start in rollout mode bring their servers up (already warm at t=0)."""
        sim = self.sim
        for u in self.units:
            if u.training:
                continue
            u.servers = [sim._add_server(tp, b, sim.t, lent=True) for tp, b in u.specs]
            u.training = False
            sim.layout = Layout(sim.layout.train, sim.layout.servers + list(u.specs), sim.layout.bucket_limits)

    # ------------------------------------------------------------ Cluster interface
    def history(self, n: int) -> list[tuple[int, ...]]:
        if COMPLETE_COHORTS:
            return self.cohorts.history(self.sim, n)
        return history_of(self.sim, n)

    def tool_returns(self) -> float:
        """Tool returns per trajectory over the finished trajectories the run keeps (0 before any)."""
        trajs = self.sim.finished_trajs if self.sim is not None else ()
        return sum(traj_tool_returns(t) for t in trajs) / len(trajs) if trajs else 0.0

    def backlog_batches(self, rec: dict) -> float:
        """A step record's queued requests in batches' worth of requests: the batch's trajectories, each one
        request plus one per tool return."""
        return rec["queued"] / (trajectories_per_step(self.env) * (1.0 + self.tool_returns()))

    def slot_fields(self) -> dict:
        """The planner's slot fields from the groups among the trajectories the run has finished."""
        sim = self.sim
        if sim is None:
            return {}
        return group_slot_fields(self.env, sim.finished_trajs, self.env.workload.cfg.group_size,
                                 sim.cfg.tool_latency_scale)

    def same_layout(self, a, b) -> bool:
        return _same(self._layout(a), self._layout(b))

    def reconfig_cost_s(self, a, b) -> float:
        """What moving from plan a to plan b costs, as this cluster's reconfigurations take it: a training-layout
        change restarts the trainer (checkpoint, re-shard, resume) while the new servers start; a rollout-only
        change costs the new servers' start, as a share of the rollout GPUs that stop serving meanwhile."""
        la, lb = self._layout(a), self._layout(b)
        sim = self.sim
        left = [tp for tp, _ in la.servers]  # a server is kept for any bucket of its TP (Simulation.apply_layout)
        new = []
        for tp, _ in lb.servers:
            if tp in left:
                left.remove(tp)
            else:
                new.append(tp)
        start = max((sim.truth.server_start_s(tp) for tp in new), default=0.0)
        if la.train != lb.train:
            return sim.cfg.reconfig_train_s + start
        gone = sum(left)
        return start * gone / max(1, sum(tp for tp, _ in la.servers))

    def end_fill(self) -> float:
        """Before the first training step: the hybrids lent for the fill stop serving (their requests
        re-prefill elsewhere) and join training at once; returns the seconds until the trainer can start (the
        joiners' snapshot fetch, _join's). Later calls return 0."""
        lent = [u for u in self.units if not u.training]
        if self.sim is None or self.sim.version > 0 or not lent or self._fill_ended:
            return 0.0  # only before step 0 (a unit released later is the controller's to join)
        self._fill_ended = True
        sim = self.sim
        for u in lent:
            self._hand_back(u)
        sim.set_train_dp(sim.train_layout.dp + len(lent))
        return self._fetch_s()

    def _fetch_s(self) -> float:
        sim, lay = self.sim, self.sim.train_layout
        return 16.0 * sim.truth.model.params / (lay.tp * lay.pp) / sim.truth.gpu.internode_bw + 5.0

    def _hand_back(self, u: HybridUnit) -> None:
        """The unit's servers stop (their requests re-prefill on the others) and it leaves the rollout layout."""
        sim = self.sim
        for s in u.servers:
            if not s.retired:
                sim.retire_server(s)
        specs = list(sim.layout.servers)
        for spec in u.specs:
            if spec in specs:
                specs.remove(spec)
        sim.layout = Layout(sim.train_layout, specs, sim.layout.bucket_limits)
        u.servers = []
        u.training = True

    def apply_plan(self, plan, step: int) -> None:
        self.apply_layout(self._layout(plan))

    def apply_layout(self, new_layout: Layout) -> None:
        """Move to `new_layout` (the plan's, before the pool is carved from it)."""
        sim, opts = self.sim, self.opts
        core, units = (make_hybrid(new_layout, opts.hybrid_replicas, self.env.knobs.hybrid_dp_div) if opts.elastic
                       else (new_layout, []))
        # The new layout's router first: the requests the retired servers carried are sent again through it (with
        # the old one, all of them went to the new layout's first bucket).
        sim.set_router(_router_for(core, opts, sim.router, knobs=self.env.knobs, env=self.env))
        sim.apply_layout(core, train_changed=True)
        self.units = units
        self._bind_units()

    def pool(self) -> PoolView:
        sim = self.sim
        lay = sim.train_layout
        n_active = sum(u.training for u in self.units)
        return PoolView(training=n_active, idle=len(self.units) - n_active, train_replicas=lay.dp,
                        rollout_gpus=sum(s.tp for s in sim.servers if not s.retired), unit_gpus=lay.tp * lay.pp)

    def join(self, n: int, step: int) -> int:
        units = [u for u in self.units if not u.training][:n]
        for u in units:
            self._join(u)
        self.sim.elastic_moves += bool(units)
        return len(units)

    def release(self, n: int, step: int) -> int:
        units = [u for u in self.units if u.training][:n]
        for u in units:
            self._release(u)
        self.sim.elastic_moves += bool(units)
        return len(units)

    def _release(self, u: HybridUnit) -> None:
        """The replica leaves training (core TP/PP untouched) and its GPUs start rollout servers again."""
        sim = self.sim
        sim.set_train_dp(sim.train_layout.dp - 1)
        u.servers = [sim._add_server(tp, b, sim.t + sim.truth.server_start_s(tp), lent=True) for tp, b in u.specs]
        u.training = False
        sim.layout = Layout(sim.train_layout, sim.layout.servers + list(u.specs), sim.layout.bucket_limits)

    def _join(self, u: HybridUnit) -> None:
        """The unit stops serving (its requests re-prefill elsewhere), fetches the model + optimizer snapshot
        while the core keeps training, then trains as one more data-parallel replica."""
        sim = self.sim
        self._hand_back(u)
        fetch = self._fetch_s()

        def activate() -> None:
            if u.training:
                sim.set_train_dp(sim.train_layout.dp + 1)

        sim.call_at(sim.t + fetch, activate)


def control_config(knobs: SimKnobs, staleness: int = AREAL_STALENESS) -> ControlConfig:
    """The shared controller's settings in the simulator: ControlConfig's defaults (re-plan every 10 steps,
    5-step cooldown between early triggers, elastic decisions 4 steps after any change and only on a verdict
    that persisted elastic_persist steps, none in the pipeline's fill), the run's staleness bound, the
    production gate cost, and the knobs that are set."""
    set_knobs = {k: v for k, v in (("replan", knobs.replan), ("elastic_persist", knobs.elastic_persist),
                                   ("elastic_project", knobs.elastic_project)) if v is not None}
    return ControlConfig(replan_policy=ReplanConfig(reconfig_cost_s=SIM_RECONFIG_COST_S), calibrate=CALIBRATE_ONLINE,
                         staleness=staleness, **set_knobs)


class SimLibraControl(Controller):
    """The simulator's step hook: turns a step record into a StepObservation for the shared controller."""

    def __init__(self, ctl: LibraController, cluster: SimCluster) -> None:
        self.ctl, self.cluster = ctl, cluster

    def attach(self, sim: Simulation) -> None:
        self.cluster.attach(sim)

    def set_run_length(self, steps: int) -> None:
        """The run's length reaches the gate (ControlConfig.last_step): the simulator's steps count from 0, so a run
        of `steps` observes its last at steps - 1 (the live adapter's counterpart: live_cluster.run_control_config)."""
        self.ctl.cfg = replace(self.ctl.cfg, last_step=steps - 1)

    def on_step_end(self, sim: Simulation, rec: dict) -> None:
        cohorts = getattr(self.cluster, "cohorts", None)
        if cohorts is not None:
            cohorts.ingest(sim)  # every step: the finished deque keeps only the last 4,000
        obs = StepObservation(step=rec["step"], interval_s=rec["interval_s"], train_s=rec["train_s"],
                              rollout_s=rec["t_rollout_s"],
                              queue_pressure=rec["queue_pressure"], active_pressure=rec["active_pressure"],
                              wait_s=rec["wait_s"], tokens=rec["final_tokens"],
                              rollout_busy=rec["rollout_busy_frac"], backlog_batches=self.cluster.backlog_batches(rec))
        self.ctl.on_step(obs, self.cluster)

    def before_train(self, sim: Simulation) -> float:
        return self.cluster.end_fill()

    @property
    def log(self) -> list[str]:
        return [f"step {e.step}: {e.kind} {e.detail}" for e in self.ctl.events]


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else 0.0


def _same(a: Layout, b: Layout) -> bool:
    return a.train == b.train and sorted(a.servers) == sorted(b.servers) and a.bucket_limits == b.bucket_limits


def bucket_tps(layout: Layout) -> list[int]:
    """The TP of each routing bucket: the one holding most of the bucket's GPUs (the larger on a tie)."""
    out = []
    for b in range(len(layout.bucket_limits)):
        gpus: dict[int, int] = {}
        for tp, bb in layout.servers:
            if bb == b:
                gpus[tp] = gpus.get(tp, 0) + tp
        out.append(max(gpus, key=lambda t: (gpus[t], t)) if gpus else 1)
    return out


def migration_pricer(env: Env, layout: Layout):
    """C-MLFQ's migration price for a layout: the Cost Evaluator on the planner's cluster spec (calibrated
    like the planner's, never the simulator's truth) and model; None without a cost spec."""
    if env.cluster is None or env.model is None:
        return None
    from areal_libra.cmlfq import MigrationPricer

    return MigrationPricer(planner_cluster(env).hardware, env.model, bucket_tps(layout))


def _router_for(layout: Layout, opts: LibraOptions, old: Router | None, fit=None,
                knobs: SimKnobs | None = None, env: Env | None = None) -> Router:
    from areal_libra.cmlfq import make_policy

    limits = layout.bucket_limits
    if len(limits) == 1:
        return PolicyRouter(make_policy("least_loaded", limits))
    if not opts.cmlfq:
        return BucketLoadRouter(limits)
    old_pol = getattr(old, "policy", None)
    tree = getattr(old_pol, "tree", None)
    knobs = knobs or SimKnobs()
    switches = {} if knobs.cmlfq_mode == "auto" else CMLFQ_SWITCHES
    # Moves priced by the Cost Evaluator; least-loaded inside the buckets while C-MLFQ's measured accuracy
    # is not above chance (cmlfq/policy.py, cmlfq/migration.py).
    extra = {"fallback": True, "pricer": migration_pricer(env, layout) if env is not None else None}
    pol = (make_policy("cmlfq", limits, tree=tree, **switches, **extra) if tree is not None
           else make_policy("cmlfq", limits, backend=TREE_BACKEND, **switches, **extra))
    if tree is not None and getattr(pol, "auto", False) and hasattr(old_pol, "inherit"):
        pol.inherit(old_pol)  # keep the auto history and switches across a re-plan
    elif hasattr(old_pol, "inherit_routing"):
        pol.inherit_routing(old_pol)  # the measured accuracy and the fallback verdict
    if tree is None and fit:
        pol.fit(fit)  # the live system starts from the prefix tree of its profiling traces
    return PolicyRouter(pol, spill_cfg=_spill_cfg(knobs))


# The rankings Libra's controller reports, by loop: the JSON key of the probe, the JSON key of the sweep's
# candidates it is held against, and how a report names the loop. "areal": the candidates as AReaL's loop ran
# them (the line); "libra": the same layouts as Libra's loop runs them, the loop the evaluator prices.
RANKING_PROBES = {"areal": ("ranking", "baseline_candidates", "AReaL's loop"),
                  "libra": ("ranking_own_loop", "loop_candidates", "Libra's loop")}

# From this step on the controller prices AReaL-Static-Optimal's candidates (the steady window of the sweep
# starts at step 5 too): the Spearman of its ranking against their measured throughput (issue 23).
RANK_FROM_STEP = 5


def baseline_ranking(env: Env, run: RunConfig | None = None) -> RankingProbe | None:
    """The sweep's candidate layouts as plans, with their measured tokens/s under the loop `run` (default
    AReaL's: AReaL-Static-Optimal's sweep; libra_run_config: static_libra_loop's). None without a cached sweep:
    the ranking is a report, never a reason to run the sweep."""
    cands = cached_sweep(env, sweep_key(env, run))
    if not cands:
        return None
    run = run or areal_run_config(env)
    loop: dict = {}
    if not run.working_set_admission:  # AReaL's loop: its KV cache evicts what its admission lets in
        mc = run.max_concurrent_groups
        groups = env.workload.cfg.batch_prompts if mc is None else mc
        loop = {"admission": "unbounded", "max_in_flight": groups * env.workload.cfg.group_size}
    plans = [layout_plan(c["rollout_gpus"], c["tp"], TrainParallel(c["train"]["tp"], c["train"]["pp"],
                                                                   c["train"]["dp"]),
                         env.workload.cfg.max_len, env.n_gpus) for c in cands]
    labels = [f"{c['rollout_gpus']}xTP{c['tp']} train {c['train']['gpus']}" for c in cands]
    return RankingProbe(plans, [c["tokens_per_s"] for c in cands], RANK_FROM_STEP, labels, loop)


def libra_run_config(env: Env) -> RunConfig:
    """Libra's loop: AReaL's staleness bound, and the version-lag bound at consumption when on (BOUND_LAG)."""
    return areal_run_config(env, strict_staleness=BOUND_LAG, edf=BOUND_LAG, working_set_admission=WORKING_SET)


def static_libra_loop(env: Env) -> SystemSpec:
    """The best static layout under Libra's loop: the same candidates as AReaL-Static-Optimal's sweep, each
    measured under libra_run_config (the version-lag bound, working-set admission) with least-loaded routing,
    the best one run. Not a rung: it splits Libra's lead over AReaL-Static-Optimal into the loop's share and
    the rest of Libra's, and its sweep is what the calibrated evaluator's ranking is held against on the loop
    it prices (baseline_ranking with libra_run_config: Libra's "ranking_own_loop")."""
    return best_static("static_libra_loop", env, libra_run_config(env), "loop", label="Libra-loop static")


def ladder_base(env: Env) -> SystemSpec:
    """Ladder rung 0, static_uniform: a half/half split with homogeneous TP (verl's example TP) under Libra's
    loop, so that each rung above it adds one lever and the loop's rule is not one of them (the bound's own
    cost is AReaL-Static-Optimal against Libra in evaluation.throughput, which keeps AReaL's rule)."""
    lay = split_layout(env, env.n_gpus // 2, BASELINE_ROLLOUT_TP)
    return SystemSpec("static_uniform", lay, libra_run_config(env), policy_router("least_loaded"))


def libra_system(name: str, env: Env) -> SystemSpec:
    knobs = env.knobs
    opts = RUNGS[name]
    # The profiling pass and the first plan, as the live run makes them (control.profile): the whole pass.
    n = profile_groups(env)
    prof = ProfilePass(n, env.workload.cfg.group_size).extend(env.workload.profile(n))
    if getattr(env, "_calibrated", None) is None:  # the pass also times one training step (PROFILE_TRAIN)
        env._train_profile_lens = train_profile_lens(env, prof.trajectories)
    slots = group_slot_fields(env, prof.trajectories, env.workload.cfg.group_size)
    cluster = SimCluster(env, opts, [])
    # Before the run the planner's slot fields are the profile's; then the finished groups' (slot_fields).
    source = SimPlanSource(env, opts.homogeneous or not opts.cmlfq,
                           lambda: cluster.slot_fields() if cluster.sim is not None else slots, cluster.tool_returns)
    cfg = control_config(knobs, env.staleness).covering(trajectories_per_step(env))
    lc = LibraController.from_profile(cfg, source, prof, triples=HISTORY_TRIPLES)
    layout = layout_from_plan(lc.plan, env.workload.cfg.max_len, knobs.train_micro_batch)
    core, cluster.units = (make_hybrid(layout, opts.hybrid_replicas, knobs.hybrid_dp_div) if opts.elastic
                           else (layout, []))
    if LEND_IN_FILL:
        core = lend_in_fill(core, cluster.units)
    ctl = SimLibraControl(lc, cluster)
    # Filled while the run goes (the same objects): each decision's prediction against the next steps, and
    # the calibration factors in force at the end.
    extra = {"predictions": lc.predictions, "cost_factors": lc.factor_record}
    if name == "libra":  # the full system only: each probe prices every candidate every step
        for loop, (key, _, _) in RANKING_PROBES.items():
            probe = baseline_ranking(env, libra_run_config(env) if loop == "libra" else None)
            if probe is not None:
                lc.rankings[key] = probe
                extra[key] = probe.record
    return SystemSpec(name, core, libra_run_config(env), lambda lay: _router_for(lay, opts, None, prof.trajectories, knobs, env), ctl,
                      extra=extra)

