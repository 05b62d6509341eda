"""An emulated cluster: N accelerators whose rollout servers and trainer take the time a real model would
take on real hardware, while the tiny CPU model computes the actual tokens.

The step times come from the simulator's hardware truth (areal_libra.sim.hardware, e.g. qwen3-14b on
h200), never from the planner's own cost model (areal_libra.cost), so the control plane is judged against
timings it does not know. Each embedded server paces every decode iteration of its continuous batch to
``truth.decode_iteration_s(tp, running, resident_tokens) * time_scale`` and every prefill likewise (see
``ServerEmulation``; an emulated server is started by this module, which injects the pacing into the embedded
server: ``python -m areal_libra.rollout.emulation --emulate-model M --emulate-gpu G [--emulate-tp T]
[--emulate-time-scale S] [--emulate-growth X --emulate-horizon H] <embedded server flags>``); the trainer
calls ``pace_train_step`` after
each step. Pacing can only slow a step down: when the tiny model's own compute takes longer than the
target (too many servers on too few cores, or a time scale too small) the iteration "overruns", and the
servers count those (``/get_server_info`` -> ``engine_stats.pace_overruns``) so a run can say how faithful
it was.

    from areal_libra.rollout.emulation import ClusterEmulation, configure, pace_train_step
    emu = ClusterEmulation.from_libra(libra_cfg)  # None unless cluster=emulated
    configure(emu)
    t0 = time.perf_counter(); ...one training step...
    pace_train_step(seq_lens, n_accel, started_at=t0)
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from typing import Any

from areal_libra.config import libra_config
from areal_libra.cost.presets import PresetError, load_hardware, load_model
from areal_libra.rollout.backend import LocalProcessBackend
from areal_libra.rollout.launcher import ServerSpec
from areal_libra.rollout.trainer_overhead import TrainerOverhead, paced_sleep
from areal_libra.server.embedded_server import parse_args, run
from areal_libra.sim.calib import calibrated_hardware
from areal_libra.sim.hardware import HardwareTruth, truth_from_specs

DEFAULT_MODEL = "qwen3-14b"
DEFAULT_GPU = "h200"
# Real seconds per emulated second. The tiny dapo_math step (3 turns of <= 48 tokens, 128 trajectories)
# takes qwen3-14b on h200 a few seconds of rollout and ~2.2 s of training on 12 accelerators; on this 2-core
# machine the tiny trainer itself needs 4-7 s and 3 servers overran 61% of their iterations at x1, so the
# default slows time 4x (trainer target ~9 s, 22% of server iterations overran; docs/dispatch.md).
DEFAULT_TIME_SCALE = 4.0
# The module that starts an emulated embedded server (main below), as the launcher's ServerSpec.entry.
SERVER_ENTRY = "areal_libra.rollout.emulation"


class EmulationError(ValueError):
    """Emulation settings that cannot be used; the message is one line naming the problem."""


def length_multiplier(version: int | str | None, growth: float, horizon: int) -> float:
    """Emulated tokens per real token at a weight version: lengths that grow linearly from 1x to
    (1 + growth)x over `horizon` versions (steps), as a policy's trajectories lengthen while it learns. The
    tiny model's tokens stay what they are; the servers' pacing, the trainer's pacing and the planner's
    length history all count each of them `length_multiplier` times."""
    if growth <= 0:
        return 1.0
    try:
        v = max(0, int(version))  # AReaL tags weights with the step number
    except (TypeError, ValueError):
        v = 0
    return 1.0 + growth * min(v, horizon) / max(1, horizon)


class GrowingPacer:
    """A server's pacer under growing lengths: every generated or tool token stands for m emulated ones (the
    prompt does not grow), so a decode iteration costs m iterations over m times the resident KV, and a
    prefill after the first turn (tool output, prior tokens cached) m times the tokens; a request's first
    prefill (nothing cached: its prompt) is not scaled."""

    def __init__(self, base: Any, growth: float, horizon: int, version_fn: Any) -> None:
        self.base, self.growth, self.horizon, self.version_fn = base, growth, horizon, version_fn

    def _m(self) -> float:
        return length_multiplier(self.version_fn(), self.growth, self.horizon)

    def decode_s(self, batch: int, resident_tokens: int) -> float:
        m = self._m()
        return m * self.base.decode_s(batch, int(resident_tokens * m))

    def prefill_s(self, chunks: Iterable[tuple[int, int]]) -> float:
        m = self._m()
        return self.base.prefill_s([(n, 0) if p == 0 else (int(n * m), int(p * m)) for n, p in chunks])


def emulated_truth(model: str, gpu: str) -> HardwareTruth:
    """The hardware truth for ``model`` on ``gpu``, built from the presets' spec-sheet facts only."""

    try:
        return truth_from_specs(load_hardware(gpu), load_model(model))
    except PresetError as e:
        raise EmulationError(str(e)) from None


def profiled_hardware(model: str, gpu: str, seed: int = 0, train_lens: tuple[int, ...] | None = None) -> Any:
    """The emulated accelerators as a profiling pass measures them: the cost preset of `gpu` (a HardwareSpec)
    fitted by the Cost Evaluator's own calibration to decode, prefill (and training) samples of the emulated
    hardware (the simulator's profiling pass, sim.calib), the hardware the simulator's Libra plans on.
    `train_lens`: the pass also times one training step of this batch per single-node layout on the emulated
    hardware (what the paced trainer takes for it) and the training efficiency is fitted to it, as the
    simulator's Libra does with its profile's batch (sim.libra.PROFILE_TRAIN)."""
    try:
        return calibrated_hardware(emulated_truth(model, gpu), load_hardware(gpu), load_model(model), seed,
                                   train_lens=train_lens)[0]
    except PresetError as e:
        raise EmulationError(str(e)) from None


def _check_scale(time_scale: float) -> float:
    try:
        s = float(time_scale)
    except (TypeError, ValueError):
        raise EmulationError(f"emulation time scale must be a number > 0, got {time_scale!r}") from None
    if not math.isfinite(s) or s <= 0:
        raise EmulationError(f"emulation time scale must be a finite number > 0, got {time_scale!r}")
    return s


def _check_tp(truth: HardwareTruth, tp: int) -> None:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise EmulationError(f"emulated TP must be an integer >= 1, got {tp!r}")
    g, m = truth.gpu, truth.model
    if tp > g.gpus_per_node:
        raise EmulationError(f"TP{tp} spans more than one {g.gpus_per_node}-accelerator {g.name} node")
    if truth.kv_capacity_tokens(tp) <= 0:
        raise EmulationError(
            f"{m.name} ({m.weight_bytes / 1e9:.0f} GB of weights) leaves no KV-cache room on {tp} x {g.name}; use a larger TP"
        )


@dataclass(frozen=True)
class ServerEmulation:
    """Pacing of one rollout server: a TP-``tp`` server of ``model`` on ``gpu``, time multiplied by
    ``time_scale``. Implements the server's Pacer protocol (areal_libra.server.batching)."""

    model: str = DEFAULT_MODEL
    gpu: str = DEFAULT_GPU
    tp: int = 1
    time_scale: float = DEFAULT_TIME_SCALE

    def __post_init__(self) -> None:
        object.__setattr__(self, "time_scale", _check_scale(self.time_scale))
        _check_tp(self.truth, self.tp)

    @cached_property
    def truth(self) -> HardwareTruth:
        return emulated_truth(self.model, self.gpu)

    def decode_s(self, batch: int, resident_tokens: int) -> float:
        """Target wall time of one decode iteration over ``batch`` running sequences holding
        ``resident_tokens`` KV tokens in all."""
        return self.time_scale * self.truth.decode_iteration_s(self.tp, max(batch, 1), resident_tokens)

    def prefill_s(self, chunks: Iterable[tuple[int, int]]) -> float:
        """Target wall time of one batched prefill: (new tokens, tokens already cached) per sequence."""
        return self.time_scale * sum(self.truth.prefill_s(self.tp, new, prior) for new, prior in chunks)

    def cli_args(self) -> tuple[str, ...]:
        """The embedded server's flags for this pacing."""
        return (
            "--emulate-model", self.model, "--emulate-gpu", self.gpu,
            "--emulate-tp", str(self.tp), "--emulate-time-scale", repr(self.time_scale),
        )

    def describe(self) -> dict[str, Any]:
        return {"model": self.model, "gpu": self.gpu, "tp": self.tp, "time_scale": self.time_scale}


@dataclass(frozen=True)
class ServerPacing:
    """The pacing an emulated server is given (the embedded server's Pacing protocol): a TP-``tp`` server of
    ``model`` on ``gpu``, lengths growing by ``growth`` over ``horizon`` weight versions (GrowingPacer)."""

    model: str = DEFAULT_MODEL
    gpu: str = DEFAULT_GPU
    tp: int = 1
    time_scale: float = DEFAULT_TIME_SCALE
    growth: float = 0.0
    horizon: int = 40

    def __post_init__(self) -> None:
        if not (isinstance(self.growth, int | float) and math.isfinite(self.growth) and self.growth >= 0) \
                or isinstance(self.horizon, bool) or not isinstance(self.horizon, int) or self.horizon < 1:
            raise EmulationError("--emulate-growth must be >= 0, --emulate-horizon >= 1")
        _ = self.emulation  # unknown model/accelerator, bad TP or time scale: fail now

    @cached_property
    def emulation(self) -> ServerEmulation:
        return ServerEmulation(self.model, self.gpu, self.tp, self.time_scale)

    def pacer(self, weight_version: Callable[[], str]) -> Any:
        if self.growth <= 0:
            return self.emulation
        return GrowingPacer(self.emulation, self.growth, self.horizon, weight_version)

    def describe(self) -> dict[str, Any]:
        return self.emulation.describe()

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def cli_args(self) -> tuple[str, ...]:
        """This module's flags for this pacing (before the embedded server's own)."""
        out = self.emulation.cli_args()
        if self.growth > 0:
            out += ("--emulate-growth", repr(self.growth), "--emulate-horizon", str(self.horizon))
        return out


def best_train_layout(truth: HardwareTruth, seq_lens: Sequence[int], n_accel: int) -> tuple[int, int, int, float]:
    """(tp, pp, dp, seconds): the fastest training layout of ``n_accel`` accelerators for this batch under
    the truth (TP inside a node, powers of two), as a tuned Megatron/FSDP job would pick."""
    best: tuple[int, int, int, float] | None = None
    tp = 1
    while tp <= min(n_accel, truth.gpu.gpus_per_node):
        if n_accel % tp == 0:
            pp = 1
            while pp <= n_accel // tp:
                if (n_accel // tp) % pp == 0:
                    dp = n_accel // (tp * pp)
                    t = truth.train_step_s(list(seq_lens), tp, pp, dp)
                    if best is None or t < best[3]:
                        best = (tp, pp, dp, t)
                pp *= 2
        tp *= 2
    if best is None:  # n_accel has no power-of-two factor layout other than pure DP
        best = (1, 1, n_accel, truth.train_step_s(list(seq_lens), 1, 1, n_accel))
    return best


def _seq_lens(tokens: int | Sequence[int], n_seqs: int) -> list[int]:
    if isinstance(tokens, int):
        if tokens < 0 or n_seqs < 1:
            raise EmulationError(f"tokens must be >= 0 and n_seqs >= 1, got {tokens}, {n_seqs}")
        base, extra = divmod(tokens, n_seqs)
        return [base + (1 if i < extra else 0) for i in range(n_seqs)]
    lens = [int(x) for x in tokens]
    if any(x < 0 for x in lens):
        raise EmulationError("sequence lengths must be >= 0")
    return lens


@dataclass(frozen=True)
class ClusterEmulation:
    """`libra.emulated`: N emulated accelerators split between the trainer and the rollout servers."""

    accelerators: int = 16
    model: str = DEFAULT_MODEL
    gpu: str = DEFAULT_GPU
    time_scale: float = DEFAULT_TIME_SCALE
    trainer_accelerators: int | None = None  # None: every accelerator the rollout servers do not use
    server_threads: int = 1  # CPU threads per emulated server: speed comes from the pacing, not threads
    length_growth: float = 0.0  # emulated lengths grow to (1 + length_growth)x over growth_horizon steps
    growth_horizon: int = 40
    # Accelerators of the Elastic Hybrid Pool (libra.elastic.hybrids, one each): outside the rollout groups
    # and the trainer's core; each adds one to the trainer while it trains and serves as a TP1 server
    # while in rollout.
    hybrid_accelerators: int = 0
    _cache: dict = field(default_factory=dict, compare=False, repr=False)
    _pool: dict = field(default_factory=dict, compare=False, repr=False)  # the pool sized with the plan

    def __post_init__(self) -> None:
        object.__setattr__(self, "time_scale", _check_scale(self.time_scale))
        for name in ("accelerators", "server_threads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise EmulationError(f"libra.emulated.{name} must be an integer >= 1, got {v!r}")
        t = self.trainer_accelerators
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
            raise EmulationError(f"libra.emulated.trainer_accelerators must be an integer >= 1 or null, got {t!r}")
        if isinstance(self.hybrid_accelerators, bool) or not isinstance(self.hybrid_accelerators, int) \
                or self.hybrid_accelerators < 0:
            raise EmulationError(f"hybrid accelerators must be an integer >= 0, got {self.hybrid_accelerators!r}")
        if not (math.isfinite(float(self.length_growth)) and self.length_growth >= 0) or self.growth_horizon < 1:
            raise EmulationError("libra.emulated.length_growth must be >= 0 and growth_horizon >= 1")
        _ = self.truth  # unknown model / accelerator: fail now

    @cached_property
    def truth(self) -> HardwareTruth:
        return emulated_truth(self.model, self.gpu)

    @classmethod
    def from_libra(cls, libra: Any) -> ClusterEmulation | None:
        """From the `libra:` config (the typed LibraConfig; a DictConfig or dict is typed first); None unless
        emulation is enabled."""

        cfg = libra_config(libra)
        em = cfg.emulated
        if not em.enabled:
            return None
        if em.host and cfg.elastic.enabled and not cfg.elastic.size_with_plan:
            raise EmulationError("the emulated host (libra.emulated.host) runs the Elastic Hybrid Pool sized with the "
                                 "plan only: set libra.elastic.size_with_plan=true")
        # A pool sized with the plan is inside the plan's training accelerators (set_plan_pool); one of fixed
        # size is outside the plan, one accelerator per hybrid.
        outside = cfg.elastic.enabled and not cfg.elastic.size_with_plan
        return cls(accelerators=em.accelerators, model=em.model, gpu=em.gpu, time_scale=em.time_scale,
                   trainer_accelerators=em.trainer_accelerators, server_threads=em.server_threads,
                   length_growth=float(em.length_growth), growth_horizon=int(em.growth_horizon),
                   hybrid_accelerators=cfg.elastic.hybrids if outside else 0)

    def multiplier(self, version: int | str | None) -> float:
        return length_multiplier(version, self.length_growth, self.growth_horizon)

    # ------------------------------------------------------------ rollout servers
    def server(self, tp: int) -> ServerEmulation:
        if tp not in self._cache:
            self._cache[tp] = ServerEmulation(self.model, self.gpu, tp, self.time_scale)
        return self._cache[tp]

    def pacing(self, tp: int) -> ServerPacing:
        """The pacing of one TP-``tp`` server of this cluster."""
        s = self.server(tp)
        return ServerPacing(s.model, s.gpu, tp, s.time_scale, float(self.length_growth), int(self.growth_horizon))

    def server_spec(self, group: Any, seed: int = 0) -> Any:
        """The launcher's ServerSpec for one server of a RolloutGroup on this emulated cluster."""

        return self.emulate_spec(ServerSpec(tp=group.tp, max_running=group.max_running, group=group.name, seed=seed))

    def emulate_spec(self, spec: Any) -> Any:
        """An existing ServerSpec made an emulated one: started by this module with the --emulate-* flags,
        on ``server_threads`` threads."""
        return replace(spec, threads=self.server_threads, entry=SERVER_ENTRY,
                       extra_args=tuple(spec.extra_args) + self.pacing(spec.tp).cli_args())

    # ------------------------------------------------------------ the accelerator budget
    def check_layout(self, groups: Sequence[Any], trainer: int | None = None) -> tuple[int, int]:
        """(rollout accelerators, trainer accelerators) of a layout; EmulationError if it does not fit.
        ``groups`` are RolloutGroups (tp, count); ``trainer`` defaults to libra.emulated.trainer_accelerators,
        else to what the servers leave."""
        for g in groups:
            try:
                self.server(int(g.tp))
            except EmulationError as e:
                raise EmulationError(f"rollout group {g.name}: {e}") from None
        rollout = sum(int(g.tp) * int(g.count) for g in groups)
        n, h = self.accelerators, self.hybrid_accelerators
        train = trainer if trainer is not None else self.trainer_accelerators
        mix = "+".join(f"{g.count}xTP{g.tp}" for g in groups) or "none"
        pool = f" + {h} hybrid" if h else ""
        if train is None:
            train = n - h - rollout
            if train < 1:
                raise EmulationError(
                    f"rollout servers ({mix}){pool} use {rollout + h} of the {n} emulated accelerators; none is left "
                    f"for the trainer"
                )
        elif rollout + train + h > n:
            raise EmulationError(
                f"layout needs {rollout} rollout ({mix}) + {train} trainer{pool} accelerators = {rollout + train + h}, "
                f"but the emulated cluster has {n} (libra.emulated.accelerators)"
            )
        return rollout, train

    def set_plan_pool(self, units: int, unit_gpus: int) -> None:
        """The Elastic Hybrid Pool sized with the plan (libra.elastic.size_with_plan): `units` of the plan's
        training replicas, `unit_gpus` accelerators each, are hybrids: inside the plan's training accelerators,
        so a hybrid that is not training takes its accelerators from the trainer."""
        self._pool.update(units=int(units), unit=max(1, int(unit_gpus)))

    def trainer_now(self, groups: Sequence[Any], training_hybrids: int = 0) -> int:
        """The trainer's accelerators now: the layout's, with the pool's. A pool outside the plan adds one per
        hybrid training; a pool sized with the plan removes the unit of each hybrid not training."""
        t = self.check_layout(groups)[1]
        units, unit = self._pool.get("units", 0), self._pool.get("unit", 1)
        if units:
            return max(1, t - (units - int(training_hybrids)) * unit)
        return t + int(training_hybrids)

    def hybrid_pacing(self) -> ServerPacing:
        """The pacing of a hybrid replica's in-process server: a TP1 server of this cluster."""
        return self.pacing(1)

    # ------------------------------------------------------------ the trainer
    def train_target_s(self, tokens: int | Sequence[int], n_accel: int, n_seqs: int = 1) -> float:
        """Target wall time of one training step on ``n_accel`` accelerators (best layout), scaled."""
        if isinstance(n_accel, bool) or not isinstance(n_accel, int) or n_accel < 1:
            raise EmulationError(f"n_accel must be an integer >= 1, got {n_accel!r}")
        lens = _seq_lens(tokens, n_seqs)
        return self.time_scale * best_train_layout(self.truth, lens, n_accel)[3]

    def pace_train_step(self, tokens: int | Sequence[int], n_accel: int, started_at: float | None = None,
                        n_seqs: int = 1, overhead_s: float = 0.0) -> dict[str, float]:
        """Sleep until the step (begun at ``started_at``, a time.perf_counter() value; None: now) has
        taken its target time. ``tokens``: per-sequence lengths (preferred: attention cost grows with each
        sequence's square), or a total split evenly over ``n_seqs``. ``overhead_s``: the trainer's own real work
        outside the window that this window absorbs (trainer_overhead.TrainerOverhead). Returns emul/* metrics:
        emul/train_compute_s is the real work the target had to hold (the window's and the overhead)."""
        target = self.train_target_s(tokens, n_accel, n_seqs)  # tokens already scaled by the caller
        t0 = time.perf_counter() if started_at is None else started_at
        measured = time.perf_counter() - t0
        sleep, overrun = paced_sleep(target, measured, overhead_s)
        if sleep > 0:
            time.sleep(sleep)
        spent = measured + max(0.0, overhead_s)
        return {
            "emul/train_target_s": target,
            "emul/train_compute_s": spent,
            "emul/train_overhead_s": max(0.0, overhead_s),
            "emul/train_sleep_s": sleep,
            "emul/train_overrun": float(overrun > 0),
            "emul/train_accelerators": float(n_accel),
            # The step's training time on the emulated hardware: the target, or the real work that overran it.
            "emul/train_s": target + overrun,
        }

    def weight_sync_target_s(self, n_servers: int) -> float:
        """The truth's weight sync to ``n_servers`` rollout servers, scaled (the emulated host paces it)."""
        return self.time_scale * self.truth.weight_sync_s(max(1, int(n_servers)))

    def describe(self, groups: Sequence[Any] = ()) -> str:
        line = f"{self.accelerators} x {self.gpu} emulating {self.model} (time x{self.time_scale:g})"
        if groups:
            r, t = self.check_layout(groups)
            line += f": trainer {t}, rollout {r} (" + "+".join(f"{g.count}xTP{g.tp}" for g in groups) + ")"
        return line


_active: ClusterEmulation | None = None


def configure(emulation: ClusterEmulation | None) -> None:
    """Set (or clear, with None) the emulation that ``pace_train_step`` uses in this process."""
    global _active
    _active = emulation


@dataclass(frozen=True)
class PacedProcessBackend:
    """cluster=emulated: the fleet's new servers as the launcher starts its own, embedded servers paced to
    the emulated hardware (ClusterEmulation.emulate_spec); one more ServerBackend (rollout/backend.py)."""

    emulation: ClusterEmulation
    inner: LocalProcessBackend = field(default_factory=LocalProcessBackend)

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def places_devices(self) -> bool:
        return self.inner.places_devices

    def start(self, weights: str, specs: Sequence[ServerSpec], log_dir: str,
              devices: Sequence[tuple[str, ...]] | None = None, weight_version: int | None = None,
              timeout: float = 600.0) -> list[Any]:
        return self.inner.start(weights, [self.emulation.emulate_spec(s) for s in specs], log_dir, devices,
                                weight_version, timeout)

    def stop(self, server: Any, timeout: float = 10.0) -> None:
        self.inner.stop(server, timeout)

    def adopt(self, addr: str, spec: ServerSpec, run_dir: str) -> None:
        return self.inner.adopt(addr, spec, run_dir)


def active() -> ClusterEmulation | None:
    return _active


def pace_train_step(tokens: int | Sequence[int], n_accel: int, started_at: float | None = None,
                    n_seqs: int = 1) -> dict[str, float] | None:
    """The trainer's hook: pace this step to the truth's training time for ``tokens`` on ``n_accel``
    accelerators (see ClusterEmulation.pace_train_step). A no-op returning None when no emulation is
    configured, so train.py can call it unconditionally."""
    if _active is None:
        return None
    return _active.pace_train_step(tokens, n_accel, started_at, n_seqs)


def pacing_report(addrs: Sequence[str], timeout: float = 5.0) -> dict[str, float]:
    """How faithful the servers' pacing was, summed over ``addrs`` (host:port): paced iterations, overruns
    (own compute longer than the target), their fraction, target and sleep seconds. Unreachable servers
    are counted in ``unreachable``."""
    import json
    import urllib.request

    out = {"paced_iterations": 0.0, "overruns": 0.0, "decode_iterations": 0.0, "decode_overruns": 0.0,
           "target_s": 0.0, "sleep_s": 0.0, "unreachable": 0.0}
    for addr in addrs:
        try:
            with urllib.request.urlopen(f"http://{addr}/get_server_info", timeout=timeout) as r:
                st = json.loads(r.read())["engine_stats"]
        except (OSError, ValueError, KeyError):
            out["unreachable"] += 1
            continue
        out["paced_iterations"] += st.get("paced_iterations", 0)
        out["overruns"] += st.get("pace_overruns", 0)
        out["decode_iterations"] += st.get("paced_decode_iterations", 0)
        out["decode_overruns"] += st.get("pace_decode_overruns", 0)
        out["target_s"] += st.get("pace_target_seconds", 0.0)
        out["sleep_s"] += st.get("pace_sleep_seconds", 0.0)
    out["overrun_fraction"] = out["overruns"] / out["paced_iterations"] if out["paced_iterations"] else 0.0
    n = out["decode_iterations"]
    out["decode_overrun_fraction"] = out["decode_overruns"] / n if n else 0.0
    return out


def pacing_error(overrun_s: float, target_s: float) -> float:
    """The emulation's fidelity: the sum of overruns over the sum of pacing targets (0 when nothing was paced)."""
    return overrun_s / target_s if target_s > 0 else 0.0


# A run whose pacing error exceeds this cannot be read as the emulated hardware's (said at the end, and in the
# live A/B's JSON instead of a ratio).
PACING_ERROR_LIMIT = 0.10


def stand_in_batch(batch: Any, n: int) -> Any:
    """The first `n` sequences of a training batch (a list of per-trajectory dicts, as AReaL's ppo_update takes
    it, or a dict of tensors with the batch first): the stand-in
    update's batch, so the real loop still updates and ships weights while its compute stays negligible."""
    if isinstance(batch, list):  # AReaL's ppo_update takes one dict per trajectory
        return batch[:n] if len(batch) > n else batch
    if not isinstance(batch, dict):
        return batch
    sizes = [v.shape[0] for v in batch.values() if hasattr(v, "shape") and len(v.shape) > 0]
    if not sizes:
        return batch
    b = max(set(sizes), key=sizes.count)  # the batch dimension
    if b <= n:
        return batch
    return {k: (v[:n] if hasattr(v, "shape") and len(v.shape) > 0 and v.shape[0] == b else v)
            for k, v in batch.items()}


def install_train_pacing(trainer: Any, emulation: Any, groups_fn: Any, metrics: Any,
                         version_fn: Any = lambda: 0, hybrids_fn: Any = lambda: 0,
                         host_pacing_fn: Any = None, train_sample: int = 0, dispatcher: Any = None,
                         rollout: Any = None) -> None:
    """cluster=emulated: every PPO update takes the truth's training time for its sequences on the
    trainer's accelerators (all the rollout servers and the hybrid pool leave, as the current layout has
    them), plus one per hybrid replica training now (`hybrids_fn`). The paced window opens when the batch is in
    hand and absorbs the trainer's own real work around it (trainer_overhead.TrainerOverhead: the batch's
    collection, the weight write, metrics, the controller), so a step takes the emulated hardware's time.
    Every step's metrics carry emul/pacing_error: the trainer's (overruns of the paced updates over their
    targets, over the run) or, the larger, the emulated host's (`host_pacing_fn`, its GET /pacing); and
    emul/train_s, emul/wait_s: the step's training time and its wait for rollout in the emulation's account,
    what the controller reads (live_cluster.observation). `dispatcher`: AReaL's task dispatcher
    (live.lag_bound.dispatcher_of), whose waits for results tell the wait for rollout from the trainer's own work in prepare_batch.
    `train_sample` > 0: the real update runs on that many sequences of the batch (a stand-in: the pacing still
    counts the whole batch). `rollout`: AReaL's rollout engine, whose submissions resume once the new weight
    version is set (resume_after_update)."""
    configure(emulation)
    actor = trainer.actor
    original = actor.ppo_update
    last: dict[str, float] = {}
    total = {"target": 0.0, "overrun": 0.0}
    ledger = TrainerOverhead()
    # perf_counter marks: the batch in hand (the window opens), the window's end, the dispatcher's waits.
    mark: dict[str, float | None] = {"ready": None, "window_end": None, "waited": 0.0, "wait_end": None}

    if dispatcher is not None and hasattr(dispatcher, "wait_results"):
        wait_results = dispatcher.wait_results

        def timed_wait(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return wait_results(*args, **kwargs)
            finally:
                mark["wait_end"] = time.perf_counter()
                mark["waited"] += mark["wait_end"] - t

        dispatcher.wait_results = timed_wait

    prepare = getattr(actor, "prepare_batch", None)
    if prepare is not None:
        def prepare_batch(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            if mark["window_end"] is not None:
                n_servers = sum(int(getattr(g, "count", 1)) for g in groups_fn())
                ledger.after_window(t0 - mark["window_end"], emulation.weight_sync_target_s(n_servers))
                mark["window_end"] = None
            mark["waited"], mark["wait_end"] = 0.0, None
            out = prepare(*args, **kwargs)
            t1 = time.perf_counter()
            after = t1 - mark["wait_end"] if mark["wait_end"] is not None else t1 - t0
            own, wait = ledger.batch(t1 - t0, mark["waited"] if dispatcher is not None else t1 - t0, after)
            last["emul/batch_overhead_s"], last["emul/wait_s"] = own, wait
            mark["own"] = own
            mark["ready"] = t1
            return out

        actor.prepare_batch = prepare_batch

    compute_adv = getattr(actor, "compute_advantages", None)
    if compute_adv is not None:  # a trainer without prepare_batch: the window opens with the advantages
        def advantages(*args: Any, **kwargs: Any) -> Any:
            if mark["ready"] is None:
                mark["ready"] = time.perf_counter()
            return compute_adv(*args, **kwargs)

        actor.compute_advantages = advantages

    def paced(*args: Any, **kwargs: Any) -> Any:
        t0 = mark["ready"] if mark["ready"] is not None else time.perf_counter()
        mark["ready"] = None
        debt = ledger.take(float(mark.pop("own", 0.0) or 0.0))
        batch = args[0] if args else next(iter(kwargs.values()), None)
        m = emulation.multiplier(version_fn())
        lens = _batch_lengths(batch, m)  # the whole batch's, before a stand-in takes a slice of it
        if train_sample > 0 and args:
            args = (stand_in_batch(args[0], train_sample), *args[1:])
        out = original(*args, **kwargs)
        n_train = emulation.trainer_now(groups_fn(), int(hybrids_fn()))
        last.update(emulation.pace_train_step(lens or 1, n_train, started_at=t0, overhead_s=debt))
        mark["window_end"] = time.perf_counter()
        last["emul/length_multiplier"] = m
        last["emul/batch_tokens"] = float(sum(lens))
        total["target"] += last["emul/train_target_s"]
        total["overrun"] += max(0.0, last["emul/train_compute_s"] - last["emul/train_target_s"])
        return out

    actor.ppo_update = paced
    if rollout is not None:
        resume_after_update(rollout)

    def fidelity() -> dict[str, float]:
        out = dict(last)
        out["emul/train_pacing_error"] = pacing_error(total["overrun"], total["target"])
        err = out["emul/train_pacing_error"]
        if host_pacing_fn is not None:
            try:
                h = host_pacing_fn()
                out["emul/host_pacing_error"] = float(h["pacing_error"])
                err = max(err, out["emul/host_pacing_error"])
            except (OSError, ValueError, KeyError):
                pass  # the host is gone (shutdown): keep the trainer's
        out["emul/pacing_error"] = err
        return out

    metrics.add_source(fidelity)

    def emulated_tokens(step: int, rec: dict) -> dict:
        # Tokens the emulated model generated this step (for throughput; the planner sees the same lengths).
        return {"emulated/gen_tokens": float(rec.get("gen_tokens", 0)) * emulation.multiplier(step - 1)}

    metrics.add_step_hook(emulated_tokens)


def resume_after_update(rollout: Any) -> None:
    """An emulated trainer's rollout takes new groups again as soon as the weight update has set the new version.
    AReaL pauses submissions before the update and resumes them after the step's stats are committed (the
    controller runs there); on this machine that work took 1-3 real seconds a step, 8-24 emulated ones at time
    scale 0.125 with no new group admitted, where the simulator's hardware admits them right after the sync.
    The work itself stays (the pacing absorbs it); only the admissions no longer wait for it."""
    pause, set_version, resume = rollout.pause, rollout.set_version, rollout.resume
    paused = {"for_update": False}

    def pause_for_update(*args: Any, **kwargs: Any) -> Any:
        paused["for_update"] = True
        return pause(*args, **kwargs)

    def set_version_then_resume(*args: Any, **kwargs: Any) -> Any:
        out = set_version(*args, **kwargs)
        if paused["for_update"]:
            paused["for_update"] = False
            resume()
        return out

    rollout.pause, rollout.set_version = pause_for_update, set_version_then_resume


def _batch_lengths(batch: Any, m: float = 1.0) -> list[int]:
    """Per-sequence emulated token counts of a training batch (a dict, or list of dicts, with attention_mask):
    the prompt (the tokens before the first one with loss_mask set) as it is, everything after it m times,
    as the planner's history counts them (LiveCluster.on_trajectory); without a loss_mask, all of it m times."""
    parts = batch if isinstance(batch, list) else [batch]
    out: list[int] = []
    for part in parts:
        emul = part.get("emul_tokens") if isinstance(part, dict) else None
        if emul is not None and hasattr(emul, "reshape"):  # an emulated host's trajectories carry their lengths
            out += [int(x) for x in emul.reshape(-1).tolist()]
            continue
        mask = part.get("attention_mask") if isinstance(part, dict) else None
        if mask is None or not hasattr(mask, "sum"):
            continue
        lens = [int(x) for x in mask.sum(-1).reshape(-1).tolist()]
        loss = part.get("loss_mask")
        if loss is None or not hasattr(loss, "argmax") or tuple(loss.shape) != tuple(mask.shape) or loss.dim() != 2:
            out += [int(x * m) for x in lens]
            continue
        has = (loss > 0).any(-1).tolist()
        first = (loss > 0).int().argmax(-1).tolist()  # index of the first generated token (left-aligned rows)
        for n, h, p in zip(lens, has, first):
            p = min(int(p), n) if h else n
            out.append(p + int((n - p) * m))
    return out


# ------------------------------------------------------------------ the emulated server's entry point
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump
        sys.stderr.write(f"emulated_server: error: {message}\n")
        raise SystemExit(2)


def parse_server_args(argv: list[str] | None = None) -> tuple[Any, ServerPacing]:
    """(the embedded server's ServerArgs, the pacing) of ``--emulate-* flags <embedded server flags>``; bad
    values exit 2 with one line (a model path without config.json: exit 1, as the server's own CLI)."""
    # The embedded server's module loads aiohttp: imported here, off the trainer's and launcher's path.

    p = _Parser(prog=f"python -m {SERVER_ENTRY}", allow_abbrev=False,
                description="An embedded server paced to a model on an accelerator (the simulator's hardware truth).")
    p.add_argument("--emulate-model", default=None, help="pace to this model's step times (e.g. qwen3-14b)")
    p.add_argument("--emulate-gpu", default=None, help="... on this accelerator (e.g. h200)")
    p.add_argument("--emulate-tp", type=int, default=None, help="... at this TP (default: --tp-size)")
    p.add_argument("--emulate-time-scale", type=float, default=1.0, help="real seconds per emulated second")
    p.add_argument("--emulate-growth", type=float, default=0.0,
                   help="emulated lengths grow to (1 + this)x over --emulate-horizon weight versions")
    p.add_argument("--emulate-horizon", type=int, default=40)
    ns, rest = p.parse_known_args(argv)
    if ns.emulate_model is None and ns.emulate_gpu is None:
        p.error("an emulated server needs --emulate-model and --emulate-gpu")
    if ns.emulate_model is None or ns.emulate_gpu is None:
        p.error("--emulate-model and --emulate-gpu must be given together")
    args = parse_args(rest)
    try:
        pacing = ServerPacing(ns.emulate_model, ns.emulate_gpu, args.tp_size if ns.emulate_tp is None else ns.emulate_tp,
                              ns.emulate_time_scale, ns.emulate_growth, ns.emulate_horizon)
    except EmulationError as e:
        p.error(str(e))
    return args, pacing


def main(argv: list[str] | None = None) -> int:

    args, pacing = parse_server_args(argv)
    return run(args, pacing)


if __name__ == "__main__":
    sys.exit(main())
