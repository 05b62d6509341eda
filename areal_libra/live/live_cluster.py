"""The live run behind the shared LibraController (areal_libra.control): the trainer-side adapter.

`LiveControl` sits in the trainer process (SPMD rank 0). After every committed training step it turns
AReaL's timings into a StepObservation and calls `LibraController.on_step` with a `LiveCluster`, which
implements the controller's Cluster interface on the real run:
- history: (prompt_tokens, final_length) of the finished trajectories of the newest complete cohorts
  (control.cohorts, as the simulator's: each trajectory by the policy version it started at, from the
  workflow's trajectory sink; the oldest version still in flight from workflows.sink.oldest_running);
- apply_plan: the plan's rollout mix as server groups (TP t = t threads per embedded server on CPU,
  `--tp-size t` per SGLang server on GPU), reconfigured live by the server fleet (drain, restart, resume);
- pool / join / release: the Elastic Hybrid Pool (live/elastic_live.py) when it is enabled.
The first plan is solved on the profiling pass before step 1 (control.profile, `libra.control.profile_groups`,
as the simulator's; live.train.profile_pass runs it), or without one from the first steps' lengths
(`libra.control.profile_steps`).
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal.api.alloc_mode import ModelAllocation

from areal_libra.control import ControlConfig, LibraController, PoolView, StepObservation
from areal_libra.control.cohorts import CohortHistory
from areal_libra.control.controller import ControlEvent
from areal_libra.control.profile import ProfileError, ProfilePass, train_batch_lens
from areal_libra.cost.presets import (
    ClusterSpec,
    ModelSpec,
    load_cluster,
    load_hardware,
    load_model,
    resolve_cluster_name,
)
from areal_libra.cost.training import TrainParallel
from areal_libra.elastic.measure import rollout_busy_share, rollout_time
from areal_libra.live.recover import plan_from_state
from areal_libra.planner import Plan, PlanError, PlannerConfig, price, solve
from areal_libra.planner.evaluate import price_terms
from areal_libra.rollout.emulation import profiled_hardware
from areal_libra.rollout.groups import RolloutGroup, groups_from_plan, resolve_groups
from areal_libra.utils import append_jsonl, first_line
from areal_libra.workflows.sink import oldest_running

if TYPE_CHECKING:
    from areal_libra.config import LibraConfig

log = logging.getLogger("areal_libra.control")


class ControlError(ValueError):
    """The control loop cannot run with this configuration (one line for the user)."""


def model_spec_from_hf(path: str | Path, name: str = "run-model") -> Any:
    """The cost model's ModelSpec of a Hugging Face checkpoint (its config.json)."""

    cfg = json.loads((Path(path) / "config.json").read_text())
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    return ModelSpec(name=name, n_layers=int(cfg["num_hidden_layers"]), hidden=hidden, n_heads=heads,
                     n_kv_heads=int(cfg.get("num_key_value_heads", heads)),
                     head_dim=int(cfg.get("head_dim") or hidden // heads), ffn=int(cfg["intermediate_size"]),
                     vocab=int(cfg["vocab_size"]), tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                     dtype_bytes=4 if "32" in dtype else 2)


@dataclass
class LivePlanSource:
    """The planner bound to the run's cluster spec and model (areal_libra.control.PlanSource)."""

    cluster: Any  # cost.presets.ClusterSpec
    model: Any  # cost.presets.ModelSpec
    config: Any  # planner.PlannerConfig

    def solve(self, history: list[tuple[int, ...]]) -> Any:

        return solve(self.cluster, self.model, history, self.config)

    def price(self, plan: Any, history: list[tuple[int, ...]]) -> float:

        return price(plan, self.cluster, self.model, history, self.config).makespan_s

    # control.CalibratedPlanSource: with these the controller calibrates online and gates re-plans on the
    # calibrated evaluator (ControlConfig.calibrate), as the simulator's Libra (sim.libra.SimPlanSource).
    def solve_calibrated(self, history: list[tuple[int, ...]], factors: Any) -> Any:
        return solve(self.cluster, self.model, history,
                     replace(self.config, train_factor=factors.train, rollout_factor=factors.rollout))

    def price_terms(self, plan: Any, history: list[tuple[int, ...]], **loop: Any) -> tuple[float, float, float]:
        return price_terms(plan, self.cluster, self.model, history, replace(self.config, **loop))


class LiveCluster:
    """areal_libra.control.Cluster on the real run."""

    def __init__(self, fleet: Any, elastic: Any = None, history_len: int = 2000,
                 max_running: int = 256, max_tokens: int = 0, groups: list[RolloutGroup] | None = None,
                 emulation: Any = None) -> None:
        self.fleet = fleet
        self.emulation = emulation
        self.version = 0  # the current step (weight version), for emulated length growth
        self.max_tokens = max_tokens
        self.elastic = elastic
        self.finished: deque[tuple[int, int]] = deque(maxlen=history_len)  # the last to finish (recover, counts)
        self.cohorts = CohortHistory()  # the controller's history: complete cohorts
        self.running_fn = oldest_running  # the oldest start version in flight (None: none)
        self.max_running = max_running
        self.reconfig_s = 0.0
        self.reconfigs = 0
        self.groups: list[RolloutGroup] = list(groups or getattr(fleet, "groups", []) or [])

    def sync(self) -> None:
        """Take the fleet's layout when it differs from the last one applied: under xccl a change lands at the
        next weight update, and one whose servers could not join is dropped there (the old layout serves)."""
        f = self.fleet
        if f is None or getattr(f, "pending", True) or not getattr(f, "groups", None):
            return
        if [(g.tp, g.count) for g in f.groups] != [(g.tp, g.count) for g in self.groups]:
            log.warning("rollout groups: the fleet serves %s, not the last plan's layout (a dropped change)",
                        ", ".join(f"{g.count}xTP{g.tp}" for g in f.groups))
            self.groups = list(f.groups)

    def on_trajectory(self, traj: Any) -> None:
        prompt, final = int(traj.prompt_tokens), int(traj.final_length)
        if self.emulation is not None:  # emulated lengths: each generated or tool token counts m times
            m = self.emulation.multiplier(self.version)
            final = prompt + int(round((final - prompt) * m))
        self.finished.append((prompt, final))
        self.cohorts.add(int(getattr(traj, "step", 0)), (prompt, final))

    def restore(self, rows: list[tuple[int, int]],
                cohorts: list[tuple[int, list[tuple[int, int]]]] | None = None) -> None:
        """The history saved before a restart (live.recover): the last finished lengths and the cohorts by start
        version; a state without cohorts gives its lengths as one old, complete cohort (version -1)."""
        self.finished.extend(rows)
        for v, vrows in cohorts if cohorts is not None else [(-1, list(rows))]:
            for r in vrows:
                self.cohorts.add(v, r)

    # ------------------------------------------------------------ Cluster interface
    def history(self, n: int) -> list[tuple[int, ...]]:
        return self.cohorts.history(n, self.running_fn())

    def signature(self, plan: Any) -> tuple:
        """What a plan puts on this cluster: the server groups (the last bucket reaching max_tokens) and the
        training layout."""
        t = plan.train
        return (tuple((g.tp, g.count, g.max_len) for g in self.groups_for(plan)),
                (t.tp, t.pp, t.dp, t.micro_batch))

    def same_layout(self, a: Any, b: Any) -> bool:
        """`b` changes nothing: same layout as `a`, and `a`'s rollout groups are the ones serving (a plan
        whose reconfiguration failed is not: moving to it again is a change)."""
        serving = tuple((g.tp, g.count, g.max_len) for g in self.groups)
        return self.signature(a) == self.signature(b) and (not serving or self.signature(a)[0] == serving)

    def groups_for(self, plan: Any) -> list[RolloutGroup]:
        """The plan's rollout mix as server groups; the last bucket takes everything up to max_tokens."""
        groups = [RolloutGroup(name=g.name, tp=g.tp, count=g.count, threads=g.tp, max_running=self.max_running,
                               max_len=g.max_len) for g in groups_from_plan(plan)]
        if self.emulation is not None:
            self.emulation.check_layout(groups)  # EmulationError (a ValueError): the plan does not fit
        if groups and self.max_tokens:
            last = groups[-1]
            groups[-1] = RolloutGroup(last.name, last.tp, last.count, last.threads, last.max_running,
                                      max(last.max_len, self.max_tokens))
        return groups

    def apply_plan(self, plan: Any, step: int) -> None:
        groups = self.groups_for(plan)
        t0 = time.monotonic()
        if self.fleet is not None:
            self.fleet.reconfigure(groups, step)  # FleetError: the old layout still serves
        self.reconfig_s = time.monotonic() - t0
        self.reconfigs += 1
        self.groups = groups
        log.info("step %d: rollout groups now %s (%.1f s)", step,
                 ", ".join(f"{g.count}xTP{g.tp}<={g.max_len}" for g in groups), self.reconfig_s)

    def pool(self) -> PoolView:
        if self.elastic is not None and hasattr(self.elastic, "pool_view"):
            return self.elastic.pool_view()
        return PoolView(training=0, idle=0, train_replicas=1, rollout_gpus=sum(g.gpus for g in self.groups),
                        unit_gpus=1)

    def join(self, n: int, step: int) -> int:
        return int(self.elastic.join(n)) if self.elastic is not None else 0

    def release(self, n: int, step: int) -> int:
        return int(self.elastic.release(n)) if self.elastic is not None else 0


def observation(step: int, rec: dict, pressure: tuple[float, float] = (0.0, 0.0),
                measured: StepObservation | None = None, inputs: dict | None = None) -> StepObservation:
    """A StepObservation from one committed step. T_train is everything the trainer does between batches
    (log-probs, advantages, the step, the weight update, AReaL's timeperf/*); T_rollout follows the elastic
    policy's shared rule (areal_libra.elastic.measure.rollout_time) from the trainer's wait for the batch.
    `measured`: the elastic pool's own measurement of the step (it also counts the backlog of finished groups,
    the rollout side's idle time and samples the servers' queues), preferred when there is one; `inputs`:
    what it computed T_rollout from (LiveElastic.rollout_inputs), so the rule runs again on the fuller train
    time."""

    interval = float(rec.get("step_time_s", 0.0))
    train = sum(float(rec.get(f"timeperf/{k}", 0.0)) for k in
                ("recompute_logp", "ref_logp", "compute_advantage", "train_step", "update_weights"))
    wait = float(rec.get("timeperf/rollout", 0.0))
    emulated = "emul/train_s" in rec and "emul/wait_s" in rec
    if emulated:
        # An emulated trainer's own account (rollout.emulation.install_train_pacing): the step's training time
        # on the emulated hardware and its wait for rollout; its real CPU work is absorbed by the pacing, as on
        # the simulator's hardware, where it does not exist.
        train, wait = float(rec["emul/train_s"]), float(rec["emul/wait_s"])
        if inputs is not None:
            inputs = {**inputs, "wait_s": wait}
    elif inputs is not None:  # finished groups left beyond the batch: the trainer did not wait for rollout
        wait = float(inputs["wait_s"]) if int(inputs["backlog"]) == 0 else 0.0
    # The calibration's inputs, as the simulator gives them: the wait, and the batch's final-length tokens
    # (known on an emulated run; 0 = unknown, the calibration then compares whole steps).
    extra = {"wait_s": wait, "tokens": float(rec.get("emul/batch_tokens", 0.0))}
    if measured is not None:
        # The pool times the engine's own step; AReaL's timings also hold what wraps it (e.g. an emulated
        # cluster's pacing). Apply the shared rule to the pool's wait/backlog/idle on the longer train time.
        full = train if emulated else max(train, measured.train_s)
        if inputs is not None:
            rollout = rollout_time(full, float(inputs["wait_s"]), int(inputs["backlog"]), int(inputs["batch"]),
                                   waited_for_count=int(inputs["backlog"]) == 0,
                                   idle_s=inputs.get("idle_s"), interval_s=inputs.get("interval_s"))
        elif measured.rollout_s > measured.train_s:  # the trainer waited: T_rollout = T_train + wait
            rollout = full + (measured.rollout_s - measured.train_s)
        else:  # rollout was ahead by the backlog's share
            rollout = full * measured.rollout_s / max(1e-9, measured.train_s)
        return StepObservation(step=step, interval_s=interval, train_s=full, rollout_s=rollout,
                               queue_pressure=measured.queue_pressure, active_pressure=measured.active_pressure,
                               **extra)
    return StepObservation(step=step, interval_s=interval, train_s=train,
                           rollout_s=rollout_time(train, wait, backlog=0, batch=1), queue_pressure=pressure[0],
                           active_pressure=pressure[1], **extra)


def trajectories_per_step(areal_cfg: Any) -> int:
    """A run's global batch in trajectories: train_dataset.batch_size prompts x gconfig.n_samples each."""
    return int(areal_cfg.train_dataset.batch_size) * int(areal_cfg.gconfig.n_samples)


def run_control_config(control: ControlConfig, areal_cfg: Any) -> ControlConfig:
    """The controller's settings for a run: `libra.control` with the run's eta (AReaL's
    rollout.max_head_offpolicyness), so its warm-up is the run's pipeline fill (eta + 1 steps), its last step
    (AReaL's total_train_steps: a live run's steps count from 1), after which no plan is credited, and a history
    covering the eta + 1 batches in flight (ControlConfig.covering: batch_size prompts x n_samples each)."""
    total = getattr(areal_cfg, "total_train_steps", None)
    cfg = replace(control, staleness=int(areal_cfg.rollout.max_head_offpolicyness),
                  last_step=int(total) if total else control.last_step)
    return cfg.covering(trajectories_per_step(areal_cfg))


def emulated_time(obs: StepObservation, time_scale: float) -> StepObservation:
    """`obs` in emulated seconds: an emulated cluster runs `time_scale` real seconds per emulated second, and the
    planner, the gate's reconfiguration cost and the simulator all count emulated seconds (at time scale 0.25 the
    calibration factors read 0.22-0.27, the time scale itself, and the gate's gain was a quarter of its price)."""
    k = 1.0 / time_scale
    return replace(obs, interval_s=obs.interval_s * k, train_s=obs.train_s * k, rollout_s=obs.rollout_s * k,
                   wait_s=obs.wait_s * k)


class LiveControl:
    """Owns the controller in the trainer: first plan after the profile steps, then one on_step per step."""

    def __init__(self, cfg: ControlConfig, source: LivePlanSource, cluster: LiveCluster, profile_steps: int = 1,
                 pressure_fn: Any = None, events_path: Path | None = None, fleet: Any = None,
                 elastic_policy: Any = None, pool_factory: Any = None) -> None:
        """`elastic_policy`: the controller's join/release policy when not its measured ElasticPolicy (the
        scripted elastic.policy.ScheduledPolicy); `pool_factory(plan, cluster)`: the Elastic Hybrid Pool sized
        with the first plan (live.elastic_live.plan_pool_factory; None: none, or one built at launch)."""
        self.pool_factory = pool_factory
        self.events_path = events_path
        self.elastic_policy = elastic_policy
        self.fleet = fleet
        if profile_steps < 1:
            raise ControlError(f"libra.control.profile_steps must be >= 1, got {profile_steps}")
        self.cfg, self.source, self.cluster = cfg, source, cluster
        self.profile_steps = profile_steps
        n = getattr(getattr(source, "cluster", None), "n_gpus", None)
        self.accelerators = int(n) if isinstance(n, int) else None  # the plan's accelerators (the figure's axis)
        self.pressure_fn = pressure_fn
        self.ctl: LibraController | None = None
        self.timeline: list[dict] = []  # per step: allocation and throughput, for the end-of-run figure
        self.decisions: list[tuple[int, str]] = []  # (step, kind) of every recorded decision, the first plan too
        self._metrics: dict[str, float] = {}
        self.resume: dict | None = None  # a saved snapshot (live.recover) to continue from
        self.failures = 0  # steps whose control decision raised (recorded; the run goes on)
        # The rollout side's busy accounting (the emulated host's GET /pacing: busy_gpu_s, serving_gpus, now_s),
        # from which each step's StepObservation.rollout_busy is measured; None: not measurable (real SGLang
        # servers report no busy time, only instantaneous running requests), the gate skips that side's check.
        self.busy_fn: Any = None
        # Called with the profiling pass before the first plan is solved on it (fit_profiled_training: the
        # planner's training efficiency fitted to a timed training step of the run's batch); None: no fit.
        self.train_fit: Any = None
        self._busy_last: tuple[float, float] | None = None
        # The rollout backlog at the step's end, in batches' worth of requests (StepObservation.backlog_batches):
        # the servers' queued requests over the batch's trajectories (a live run does not count tool returns per
        # trajectory, so a queued turn counts as a trajectory's request); None: not measured, 0.
        self.backlog_fn: Any = None

    def on_step(self, step: int, rec: dict) -> dict[str, float]:
        """Called once per committed step with that step's flat record; returns plan/* metrics."""
        self.cluster.version = step
        self.cluster.sync()
        pressure = self.pressure_fn() if self.pressure_fn is not None else (0.0, 0.0)
        elastic = self.cluster.elastic
        measured = elastic.observation() if elastic is not None and hasattr(elastic, "observation") else None
        inputs = elastic.rollout_inputs() if measured is not None and hasattr(elastic, "rollout_inputs") else None
        obs = replace(observation(step, rec, pressure, measured, inputs), rollout_busy=self.rollout_busy(),
                      backlog_batches=self.backlog_batches())
        emu = getattr(self.cluster, "emulation", None)
        if emu is not None:
            obs = emulated_time(obs, float(emu.time_scale))
        served = self._layout()  # the layout that served this step (decisions below change the next one)
        out: dict[str, float] = {}
        try:
            self._decide(step, obs, out)
        except Exception as e:  # noqa: BLE001 - runs in AReaL's stats hook: a failure here must not end the run
            self.failures += 1
            self._record({"step": step, "event": "control_failed", "detail": (
                f"{type(e).__name__}: {first_line(e)}; the layout in force keeps serving")})
        if self.ctl is not None:
            out.update(self.ctl.metrics())
        out["plan/reconfig_s"] = self.cluster.reconfig_s
        out["plan/reconfigurations"] = float(self.cluster.reconfigs)
        self.cluster.reconfig_s = 0.0
        row = self._layout()
        row.update(step=step, serving=served, **self._throughput(rec))
        self.timeline.append(row)
        self._metrics = out
        return out

    def rollout_busy(self) -> float | None:
        """The rollout side's busy share since the last call (elastic.measure.rollout_busy_share, the simulator's
        definition) from `busy_fn`'s cumulative counters; None without a source, on its first reading or when
        it does not answer."""
        if self.busy_fn is None:
            return None
        try:
            h = self.busy_fn()
            busy, gpus, now = float(h["busy_gpu_s"]), int(h["serving_gpus"]), float(h["now_s"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        last, self._busy_last = self._busy_last, (busy, now)
        if last is None or now <= last[1]:
            return None
        return rollout_busy_share(busy - last[0], now - last[1], gpus)

    def backlog_batches(self) -> float:
        """`backlog_fn`'s reading (0 without one or when it fails)."""
        if self.backlog_fn is None:
            return 0.0
        try:
            return max(0.0, float(self.backlog_fn()))
        except (OSError, ValueError, TypeError):
            return 0.0

    def _decide(self, step: int, obs: StepObservation, out: dict[str, float]) -> None:
        if self.ctl is None and self.resume is not None:
            self._resume(step)
        if self.ctl is None:
            if step >= self.profile_steps and len(self.cluster.finished) >= self.cfg.min_history:
                self._start(step)
        else:
            predicted = self.ctl.last_predicted_s
            events = self.ctl.on_step(obs, self.cluster)
            for e in events:
                self._record({"step": e.step, "event": e.kind, "detail": e.detail})
            out["plan/predicted_vs_measured_step"] = predicted / obs.interval_s if obs.interval_s > 0 else 0.0
            # What the elastic policy read this step (T_train/T_rollout as the controller saw them).
            out["plan/obs_train_s"], out["plan/obs_rollout_s"] = obs.train_s, obs.rollout_s
            if obs.rollout_busy is not None:
                out["plan/obs_rollout_busy"] = obs.rollout_busy
            out["plan/events"] = float(len(events))

    def _changed_at(self, step: int) -> bool:
        """`step`'s decisions changed the layout (the one after it differs from the one that served it)."""
        row = next((r for r in self.timeline if r["step"] == step), None)
        return row is not None and (row["rollout_gpus"], row["train_gpus"], row["alloc"]) != (
            row["serving"]["rollout_gpus"], row["serving"]["train_gpus"], row["serving"]["alloc"])

    def start_from_profile(self, profile: ProfilePass, step: int = 0) -> None:
        """The first plan on a profiling pass (control.profile), before step 1 (`step` 0) as in the simulator: the
        controller starts from it (LibraController.from_profile) and the plan is applied at once. A pass that
        lost trajectories (a failed rollout) is planned on what finished, and says so in its event line."""
        self._record({"step": step, "event": "profile", "detail": profile.summary()})
        if self.train_fit is not None:
            self.train_fit(profile)
        try:
            ctl = LibraController.from_profile(self.cfg, self.source, profile, self.elastic_policy, partial=True)
        except ProfileError as e:
            raise ControlError(str(e)) from None
        except PlanError as e:
            raise ControlError(f"the planner found no plan for this run: {e}") from None
        served = self._layout()  # the launch layout, which served the pass
        self.rollout_busy()  # the busy clock starts at the pass's end, as the steps' do (StepMetrics.start_clock)
        self._start(step, ctl)
        self.timeline.append({**self._layout(), "step": step, "serving": served, "tokens_per_s": None,
                              "unit": "profiling pass"})

    def _start(self, step: int, ctl: LibraController | None = None) -> None:
        """The first plan (`ctl`'s, from a profiling pass; else solved on the finished trajectories of the profile
        steps); applied when it differs from the start layout."""

        if ctl is None:
            hist = self.cluster.history(self.cfg.history)
            try:
                ctl = LibraController(self.cfg, self.source, self.source.solve(hist), self.elastic_policy)
            except PlanError as e:
                raise ControlError(f"the planner found no plan for this run: {e}") from None
        plan = ctl.plan
        self._record({"step": step, "event": "initial_plan", "detail": plan.summary()})
        if [(g.tp, g.count, g.max_len) for g in self.cluster.groups_for(plan)] != [
                (g.tp, g.count, g.max_len) for g in self.cluster.groups]:
            try:
                self.cluster.apply_plan(plan, step)
            except (RuntimeError, ValueError) as e:  # FleetError: the launch layout keeps serving
                # The controller still starts (elastic decisions, re-plans); LiveCluster.same_layout compares
                # with the layout that serves, so a later re-plan to this plan is tried again.
                self._record({"step": step, "event": "reconfig_failed", "detail": (
                    f"first plan {plan.rollout_alloc()} not applied: {first_line(e)}; the launch layout "
                    f"{self.allocation()} keeps serving")})
        if self.pool_factory is not None and self.cluster.elastic is None:
            pool = self.pool_factory(plan, self.cluster)
            if pool is not None:  # its own step observation carries the pressure window from now on
                self.cluster.elastic, self.pressure_fn = pool, None
            self._record({"step": step, "event": "pool", "detail": getattr(
                pool, "describe", lambda: "no hybrid: the plan's training layout leaves none")()})
        self.ctl = ctl

    def _resume(self, step: int) -> None:
        """Continue from the saved controller (live.recover): its plan's layout is brought back (the
        restarted servers start in the launch layout), then it decides on this step as if it never stopped.
        A state that does not load: one line, and the ordinary first plan."""

        snap, self.resume = self.resume, None
        try:
            if snap.get("controller") is None or snap.get("plan") is None:
                raise ValueError("no controller had started")
            plan = plan_from_state(snap["plan"])
            events = [ControlEvent(*e) for e in snap.get("events", [])]
            ctl = LibraController.from_state(self.cfg, self.source, plan, snap["controller"], events,
                                             self.elastic_policy)
            if [(g.tp, g.count, g.max_len) for g in self.cluster.groups_for(plan)] != [
                    (g.tp, g.count, g.max_len) for g in self.cluster.groups]:
                self.cluster.apply_plan(plan, step)
        except (ValueError, RuntimeError) as e:  # FleetError is a RuntimeError: the launch layout serves
            print(f"areal_libra recover: controller state of step {snap.get('step')} not restored ({e}); "
                  "the controller starts fresh", flush=True)
            return
        self.ctl = ctl
        self._record({"step": step, "event": "resumed", "detail": (
            f"controller state of step {snap['step']}: plan {plan.rollout_alloc()} train {plan.train_alloc()}, "
            f"{ctl.replans} re-plans, last re-plan step {ctl.last_replan}, last change "
            f"{ctl.last_change}, {len(ctl.verdicts)} elastic verdicts pending")})

    def _record(self, event: dict) -> None:
        """Control decisions go to <run_dir>/control_events.jsonl and the trainer log."""
        print(f"areal_libra control: step {event['step']}: {event['event']}: {event['detail']}", flush=True)
        self.decisions.append((int(event["step"]), str(event["event"])))
        if self.events_path is not None:

            append_jsonl(self.events_path, event)

    def allocation(self) -> str:
        """The current rollout allocation, e.g. 'rollout 1xTP1+1xTP2' (the progress line shows it)."""
        return "rollout " + "+".join(f"{g.count}xTP{g.tp}" for g in self.cluster.groups)

    def step_metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def close(self, figure: Path) -> None:
        """End of run: the allocation figure, then the fleet's weight hook and kept checkpoint."""
        try:
            self.write_figure(figure)
        finally:
            if self.fleet is not None:
                self.fleet.close()

    def _layout(self) -> dict[str, float | None]:
        """Rollout and training accelerators now: the fleet's groups and, on an emulated cluster, the
        trainer's share of the emulated accelerators (with the hybrids training now)."""
        rollout = sum(g.gpus for g in self.cluster.groups)
        train = None
        emu = getattr(self.cluster, "emulation", None)
        if emu is not None:
            el = self.cluster.elastic
            try:
                train = emu.trainer_now(self.cluster.groups, int(el.training_hybrids()) if el is not None and
                                        hasattr(el, "training_hybrids") else 0)
            except ValueError:
                train = None
        elif self.accelerators is not None:
            train = self.accelerators - rollout
        return {"rollout_gpus": rollout, "train_gpus": train, "alloc": self.allocation()}

    def _throughput(self, rec: dict) -> dict[str, float | str]:
        """The step's tokens/s and what they are: emulated tokens per emulated second on an emulated cluster,
        else the real model's tokens per second of this machine."""
        emu = getattr(self.cluster, "emulation", None)
        if emu is None:
            return {"tokens_per_s": float(rec.get("throughput_tokens_per_s", 0.0)),
                    "unit": "real tokens/s (this machine)"}
        wall = float(rec.get("step_time_s", 0.0)) / float(emu.time_scale)
        tokens = float(rec.get("gen_tokens", 0.0)) * emu.multiplier(self.cluster.version - 1)
        return {"tokens_per_s": tokens / wall if wall > 0 else 0.0,
                "unit": "emulated tokens/s (emulated time)"}

    def write_figure(self, path: Path) -> Path | None:
        """Allocation (from the start layout on) and throughput over steps (PNG), written at the end of the run:
        rollout and training accelerators that served each step, each reconfiguration and elastic move marked
        at the step it was decided, tokens/s labelled emulated or real."""
        if not self.timeline:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = self.timeline
        # Step 0: the start layout (what served the first step, or the profiling pass before it); then what served
        # each step after.
        steps = [rows[0]["step"] - 1 if rows[0]["step"] == 0 else 0] + [r["step"] for r in rows]
        roll = [rows[0]["serving"]["rollout_gpus"]] + [r["rollout_gpus"] for r in rows]
        train = [rows[0]["serving"]["train_gpus"]] + [r["train_gpus"] for r in rows]
        fig, (a, b) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
        a.step(steps, roll, where="post", label=f"rollout (start: {rows[0]['serving']['alloc'].replace('rollout ', '')})",
               color="tab:blue")
        if all(t is not None for t in train):
            a.step(steps, train, where="post", label="training", color="tab:orange")
        top = max([v for v in roll + train if v is not None] + [self.accelerators or 0, 1])
        a.set_ylim(0, top * 1.12)
        a.set_ylabel("accelerators")
        styles = {"initial_plan": ("tab:red", "reconfiguration"), "replan": ("tab:red", "reconfiguration"),
                  "join": ("tab:green", "elastic join"), "release": ("tab:purple", "elastic release")}
        seen: set[str] = set()
        for step, kind in getattr(self, "decisions", []):
            if kind not in styles or (styles[kind][1] == "reconfiguration" and not self._changed_at(step)):
                continue  # a plan that kept the layout
            color, label = styles[kind]
            a.axvline(step, color=color, lw=0.9, ls="--", label=None if label in seen else label)
            after = next((r for r in rows if r["step"] == step), None)
            if after is not None:  # what the decision switched to (the TP mix changes at equal counts too)
                a.annotate(after["alloc"].replace("rollout ", ""), (step, top * 1.02), fontsize=6, color=color)
            seen.add(label)
        a.legend(fontsize=7, loc="best")
        measured = [r for r in rows if r["tokens_per_s"] is not None]  # not the profiling pass's row
        b.plot([r["step"] for r in measured], [r["tokens_per_s"] for r in measured], marker=".")
        b.set_ylabel(rows[-1]["unit"], fontsize=8)
        b.set_xlabel("training step (0: the start layout; -1 to 0: the profiling pass on it, then the first plan)"
                     if rows[0]["step"] == 0 else "training step (0: the start layout)")
        a.set_title("Libra: accelerators per step and throughput (dashed: decisions)")
        fig.tight_layout()
        tmp = path.with_suffix(".tmp.png")
        fig.savefig(tmp, dpi=80)
        plt.close(fig)
        tmp.replace(path)
        return path


def megatron_available() -> bool:
    """megatron-core imports here (what AReaL's MegatronEngine needs besides CUDA)."""
    import importlib.util

    try:
        return importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError):  # no `megatron` package at all
        return False


def train_layout(alloc: str) -> tuple[str, TrainParallel]:
    """(backend, layout) of an AReaL training allocation (actor.backend: fsdp:d4, fsdp:d2t2, megatron:d2t2p1),
    parsed by AReaL's own parser; ControlError (one line) for a bad or MoE string."""
    try:
        a = ModelAllocation.from_str(str(alloc), name="actor")
    except Exception as e:  # noqa: BLE001 - AReaL raises several error types for a bad string
        raise ControlError(f"actor.backend={alloc}: not an AReaL training allocation ({_first_line(e)})") from None
    if a.backend not in ("fsdp", "megatron"):
        raise ControlError(f"actor.backend={alloc}: the live trainer runs fsdp or megatron, not {a.backend}")
    par = a.parallel
    if par.expert_parallel_size > 1 or par.context_parallel_size > 1:
        raise ControlError(f"actor.backend={alloc}: expert or context parallelism is not planned live")
    return a.backend, TrainParallel(tp=par.tensor_parallel_size, pp=par.pipeline_parallel_size,
                                    dp=par.data_parallel_size)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


# Dispatch policies that route without looking at a request's length: the planner plans one TP for them
# (PlannerConfig.routing).
BLIND_POLICIES = ("least_loaded", "round_robin")


def plan_source(libra: LibraConfig, areal_cfg: Any, model_path: str, model: Any = None,
                train_backend: str | None = None, train_gpus: int | None = None) -> LivePlanSource:
    """The planner for this run: `libra.control.cluster` (cost preset, resized to `accelerators`), the run's
    model (its config.json, or `model`: a ModelSpec), one step's batch, AReaL's staleness bound.

    The training side on cuda: `train_backend` fsdp (TP, no PP: AReaL's FSDP engine) or megatron (TP x PP x DP)
    on exactly `train_gpus` when given; None (the trainer's own view): the layout it runs (actor.backend, which
    the launch sized from its plan), so a live plan's rollout side always fits the GPUs the trainer leaves.
    The CPU trainer is one FSDP process: no TP, no PP. An emulated cluster plans freely (megatron)."""

    c = libra.control
    emulated = libra.emulated if libra.emulated.enabled else None
    name = str(emulated.gpu) if emulated is not None else str(c.cluster)
    try:
        # "auto" is resolved by the launcher (which sees every GPU; the trainer sees its own); here too for
        # other callers.
        if emulated is None:
            name = resolve_cluster_name(name, libra.device)
        # An emulated cluster: its accelerators, resized below (any count, not only whole nodes).
        cluster = (ClusterSpec(load_hardware(name), nodes=1, gpus_per_node=1) if emulated is not None
                   else load_cluster(name))
    except (ValueError, OSError) as e:
        raise ControlError(f"libra.control.cluster={name}: {e}") from None
    n = 0
    if int(c.accelerators) > 0 and emulated is None:
        n = int(c.accelerators)
    elif emulated is None and name == "cpu":
        # The embedded CPU cluster plans what the config grants: trainer threads + the servers' TP.

        groups = resolve_groups(libra, int(areal_cfg.gconfig.max_tokens))
        n = int(libra.trainer_threads) + sum(g.tp * g.count for g in groups)
    if emulated is not None:
        # A fixed pool's accelerators are the elastic pool's, not the plan's (rollout.emulation); a pool sized with
        # the plan is made of the plan's own training replicas.
        hybrids = int(libra.elastic.hybrids) if libra.elastic.enabled and not libra.elastic.size_with_plan else 0
        n = int(emulated.accelerators) - hybrids
    if n > 0:
        cluster = ClusterSpec(cluster.hardware, nodes=1, gpus_per_node=n, name=f"{cluster.hardware.name}x{n}")
    batch = trajectories_per_step(areal_cfg)
    # The servers the run starts (libra.rollout_alloc wins over rollout_groups, as at launch): their batch cap.
    servers = resolve_groups(libra, int(areal_cfg.gconfig.max_tokens))
    max_running = int(servers[0].max_running) if servers else 256
    cfg = PlannerConfig(allowed_tp=tuple(int(t) for t in c.allowed_tp), global_batch=batch, mode="async",
                        staleness=int(areal_cfg.rollout.max_head_offpolicyness), max_running=max_running,
                        rollout_backend="embedded" if str(libra.device) == "cpu" else "sglang",
                        routing="blind" if str(libra.scheduler.policy) in BLIND_POLICIES else "by_length")
    if emulated is not None:  # plan for the emulated model on the emulated accelerators
        if emulated.profile_planner:  # as a profiling pass measures them (the simulator's Libra plans so)
            cluster = replace(cluster, hardware=profiled_hardware(str(emulated.model), str(emulated.gpu),
                                                                  int(emulated.seed)))
        return LivePlanSource(cluster, load_model(str(emulated.model)), cfg)
    if str(libra.device) != "cuda":  # the CPU trainer is one FSDP process: no tensor or pipeline parallelism
        cfg = replace(cfg, train_tp=(1,), max_pp=1, train_backend="fsdp")
    elif train_backend is None:  # the running trainer's layout, exactly its GPUs
        backend, par = train_layout(str(areal_cfg.actor.backend))
        cfg = replace(cfg, train_backend=backend, train_tp=(par.tp,), max_pp=par.pp if backend == "megatron" else 1,
                      min_train_gpus=par.gpus, max_train_gpus=par.gpus)
    else:
        if train_backend not in ("fsdp", "megatron"):
            raise ControlError(f"train_backend must be fsdp or megatron here, got {train_backend!r}")
        cfg = replace(cfg, train_backend=train_backend, max_pp=cfg.max_pp if train_backend == "megatron" else 1)
        if train_gpus is not None:
            cfg = replace(cfg, min_train_gpus=train_gpus, max_train_gpus=train_gpus)
    return LivePlanSource(cluster, model if model is not None else model_spec_from_hf(model_path), cfg)


def fit_profiled_training(source: LivePlanSource, emulated: Any, profile: ProfilePass, batch: int) -> bool:
    """The profiling pass's training step on an emulated cluster: one global batch of the pass's final lengths
    (control.profile.train_batch_lens, the simulator's batch) timed on the emulated hardware per single-node
    layout (the time the paced trainer takes for it) and the planner's hardware re-fitted with it
    (rollout.emulation.profiled_hardware with train_lens: decode, prefill and training, the Cost Evaluator's own
    calibration, as the simulator's Libra). False when the pass finished nothing (the spec stays)."""
    lens = train_batch_lens(profile.trajectories, batch)
    if lens is None:
        return False
    source.cluster = replace(source.cluster, hardware=profiled_hardware(str(emulated.model), str(emulated.gpu),
                                                                        int(emulated.seed), train_lens=lens))
    return True


# The launch plans for the worst case: every trajectory at gconfig.max_new_tokens.
def _worst_case(areal_cfg: Any) -> list[tuple[int, int]]:
    return [(64, 64 + int(areal_cfg.gconfig.max_new_tokens))] * 32


def launch_plan(libra: LibraConfig, areal_cfg: Any, model_path: str, model: Any = None,
                train_gpus: int | None = None) -> Plan:
    """The plan a launch starts: solved once on a worst-case history before anything starts (a cluster the
    model cannot fit is a one-line ControlError). On cuda it picks the trainer's engine (`libra.train_backend`;
    auto: megatron when the best layout needs TP or PP > 1 and megatron-core imports, else fsdp; with the
    elastic pool always fsdp:d1, the single-rank core its hook drives) and sizes it; `train_gpus`: the training
    GPUs when the rollout side is given (libra.rollout_alloc). The plan's train_alloc() is the trainer's
    actor.backend."""

    want = str(libra.train_backend)
    history = _worst_case(areal_cfg)
    cluster = str(libra.control.cluster)

    def solve_for(backend: str | None) -> Plan:
        src = plan_source(libra, areal_cfg, model_path, model=model, train_backend=backend, train_gpus=train_gpus)
        try:
            return src.solve(history)
        except PlanError as e:
            how = f" with train_backend={backend}" if backend else ""
            raise ControlError(f"no plan fits libra.control.cluster={cluster}{how}: {e}") from None

    if str(libra.device) != "cuda" or libra.emulated.enabled:
        return solve_for(None)
    if libra.elastic.enabled:  # the pool's hook drives a single-rank FSDP core (docs/elastic.md)
        if train_gpus not in (None, 1):
            raise ControlError(f"libra.elastic supports a single-rank fsdp:d1 trainer, but the rollout servers leave "
                               f"it {train_gpus} GPUs; give libra.rollout_alloc one GPU less than the node")
        train_gpus = 1
        return solve_for("fsdp")
    if want == "auto":
        want = "fsdp"
        if megatron_available():
            try:
                plan = solve_for("megatron")
            except ControlError:
                plan = None
            if plan is not None and (plan.train.tp > 1 or plan.train.pp > 1):
                return plan
    return solve_for(want)


def check_feasible(libra: LibraConfig, areal_cfg: Any, model_path: str) -> str:
    """Solve once on a worst-case history (every trajectory at gconfig.max_new_tokens) before anything
    starts, so that a cluster the model cannot fit is a one-line error at launch; returns the plan summary."""

    return launch_plan(libra, areal_cfg, model_path).summary()
