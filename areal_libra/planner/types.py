"""Planner configuration and result types (Plan, RolloutInstance, PlannerConfig, PlanError)."""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_libra.cost.training import TrainParallel
from areal_libra.planner.train_tree import PruneRecord


class PlanError(ValueError):
    """No valid plan; the message names the binding constraint in one line."""


DEFAULT_TP = (1, 2, 4, 8)


@dataclass(frozen=True)
class PlannerConfig:
    allowed_tp: tuple[int, ...] = DEFAULT_TP  # rollout server TP degrees (the default is trimmed to a node)
    n_samples: int = 64  # stratified sample of the length history the rollout DP works on
    global_batch: int = 512  # sequences per training step (= trajectories per rollout batch)
    min_train_gpus: int = 1
    max_train_gpus: int | None = None
    min_rollout_gpus: int = 1
    train_tp: tuple[int, ...] = (1, 2, 4, 8)
    train_ep: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    max_pp: int = 16
    tp_comm_max: float = 0.5
    bubble_max: float = 0.3
    max_running: int = 256  # per rollout server
    recompute: bool = True
    logprob_passes: int = 1
    train_backend: str = "megatron"
    rollout_backend: str = "sglang"
    max_split_candidates: int = 6  # train sizes compared once the optimal makespan is known
    # "sync": rollout is one batch's makespan (bounded by its longest request). "async": AReaL's
    # staleness-bounded loop with `staleness` = eta: eta + 1 batches in flight, rollout priced at the servers'
    # sustained throughput, the longest request only needing to finish within the window.
    mode: str = "sync"
    staleness: int = 0
    # async mode: each weight update flushes the servers' KV and the resident requests prefill again
    # (RolloutCost.group_makespan_s `reprefill`)
    reprefill_on_sync: bool = True
    # TPs that may take rollout GPUs the plan's own TPs leave idle (a budget that is not a multiple of them),
    # as extra servers for the slowest group; () leaves them idle.
    fill_tp: tuple[int, ...] = DEFAULT_TP
    # Per-term calibration factors measured online (areal_libra.control.calibration): the Cost Evaluator's
    # training and rollout times are multiplied by them, in solve and in price alike, so a term measured
    # slower than modelled gets more GPUs. 1.0: the model as it is.
    train_factor: float = 1.0
    rollout_factor: float = 1.0
    # async mode: the in-flight slot statistics of the history's GRPO groups (RolloutCost.group_makespan_s
    # `slot_output`, `slot_wait_s`; areal_libra.planner.slots): E over groups of their longest member's
    # generated tokens and of its tool waits. None: the critical path of the single longest request instead.
    slot_output: float | None = None
    slot_wait_s: float = 0.0
    # async mode: a running request's resident KV is length-biased (E[o^2] / 2E[o] of its interval's
    # generated tokens, RolloutCost.group_makespan_s `resident_output`) instead of half the mean
    length_biased_kv: bool = True
    # async mode: price the servers at the concurrency the loop's own step sustains (RolloutCost.group_makespan_s
    # `step_s`; solve and price find the step as a fixed point) instead of always the window's full
    # concurrency, which holds only while rollout is the bottleneck
    sustained_concurrency: bool = True
    # The loop's admission rule, for pricing a plan under another loop than Libra's: "working_set" (Libra's: no
    # trajectory starts while the running ones' contexts fill the KV cache, so tool returns find their context)
    # or "unbounded" (AReaL's: every trajectory the staleness bound lets start is admitted, and the contexts
    # that do not fit are evicted and prefilled again at their tool returns, RolloutCost.evicted_reprefill_s).
    admission: str = "working_set"
    tool_returns: float = 0.0  # "unbounded": tool returns per trajectory, measured on finished trajectories
    max_in_flight: int = 0  # "unbounded": trajectories in flight at most (AReaL's max_concurrent_rollouts); 0: none
    # How the train/rollout split is chosen when the rollout mix has several TPs. "homogeneous": the split of
    # the best single-TP plan, the mix then solved within its rollout budget (solve.split_on_homogeneous); a
    # mix is priced as if every request ran on its length interval's TP, which no router achieves (least-
    # loaded is length-blind, C-MLFQ starts each request in the smallest bucket), and that optimism, used to
    # choose the split, took training GPUs for rollout (R2E-Gym at 16 x 8: 28 rollout GPUs where 24 ran
    # faster). "joint": the split and the mix solved together, as Libra's planner does.
    split: str = "homogeneous"
    # The router the rollout servers get. "by_length" (C-MLFQ and the other length-aware policies): a request
    # goes to the bucket of its length interval, as the rollout DP prices a mix. "blind" (least-loaded per GPU;
    # round-robin, per server, is worse still for a mix): every rollout GPU draws the same share of the whole
    # length distribution, so a server of TP t holds the same requests, and costs the same, in any mix on the
    # same GPUs; a mix's makespan, the slowest of its groups, is then never below the best single TP's, and
    # solve plans one TP.
    routing: str = "by_length"

    def __post_init__(self) -> None:
        if self.routing not in ("by_length", "blind"):
            raise ValueError(f"routing must be by_length or blind, got {self.routing!r}")
        if self.admission not in ("working_set", "unbounded"):
            raise ValueError(f"admission must be working_set or unbounded, got {self.admission!r}")
        if self.split not in ("homogeneous", "joint"):
            raise ValueError(f"split must be homogeneous or joint, got {self.split!r}")
        if self.tool_returns < 0 or self.max_in_flight < 0:
            raise ValueError("tool_returns and max_in_flight must be >= 0")

    @property
    def rollout_window(self) -> float:
        return float(self.staleness + 1) if self.mode == "async" else 1.0


@dataclass(frozen=True)
class RolloutInstance:
    """`count` servers of TP `tp` serving requests up to `max_len` tokens (the DP interval's longest)."""

    tp: int
    count: int
    max_len: int
    min_len: int = 0
    t_s: float = 0.0  # predicted makespan of this group
    filler: bool = False  # extra servers on GPUs the plan's TPs left idle (PlannerConfig.fill_tp); no bucket

    @property
    def gpus(self) -> int:
        return self.tp * self.count


@dataclass(frozen=True)
class Interval:
    """One DP interval for --explain: sample indices, lengths, and what serves it."""

    lo: int
    hi: int
    min_len: int
    max_len: int
    requests: float  # real requests of one rollout batch this interval stands for
    tp: int
    count: int
    t_s: float


@dataclass
class Plan:
    train: TrainParallel
    rollout_gpus: int
    instances: list[RolloutInstance]
    t_train_s: float
    t_rollout_s: float
    makespan_s: float
    solve_s: float
    n_gpus: int = 0
    train_backend: str = "megatron"
    rollout_backend: str = "sglang"
    idle_gpus: int = 0
    notes: list[str] = field(default_factory=list)
    tree_log: list[PruneRecord] = field(default_factory=list)
    intervals: list[Interval] = field(default_factory=list)
    train_breakdown: dict[str, float] = field(default_factory=dict)

    @property
    def train_gpus(self) -> int:
        return self.train.gpus

    def train_alloc(self) -> str:
        return self.train.alloc(self.train_backend)

    def tp_counts(self) -> list[tuple[int, int]]:
        """(tp, servers) per distinct TP, ascending."""
        out: dict[int, int] = {}
        for i in self.instances:
            out[i.tp] = out.get(i.tp, 0) + i.count
        return sorted(out.items())

    def rollout_alloc(self) -> str:
        """One group per distinct TP, ascending: sglang:d2t1+d1t2+d1t4."""
        return f"{self.rollout_backend}:" + "+".join(f"d{c}t{tp}" for tp, c in self.tp_counts())

    def buckets(self) -> list[tuple[int, int]]:
        """Strictly ascending (max_len threshold, tp) from the DP intervals; neighbours with the same TP merge,
        and groups ending at the same length share one bucket (the larger TP names it), so a router never
        sees a duplicate threshold."""
        out: list[tuple[int, int]] = []
        for inst in sorted((i for i in self.instances if not i.filler), key=lambda i: (i.max_len, i.tp)):
            if out and (out[-1][1] == inst.tp or out[-1][0] == inst.max_len):
                out[-1] = (max(out[-1][0], inst.max_len), max(out[-1][1], inst.tp))
            else:
                out.append((inst.max_len, inst.tp))
        return out

    def to_json(self) -> dict:
        t = self.train
        return {
            "train": {"gpus": t.gpus, "tp": t.tp, "pp": t.pp, "dp": t.dp, "ep": t.ep, "micro_batch": t.micro_batch,
                      "backend": self.train_backend},
            "rollout": {"gpus": self.rollout_gpus, "instances": [{"tp": tp, "count": c} for tp, c in self.tp_counts()],
                        "backend": self.rollout_backend},
            "t_train_s": round(self.t_train_s, 6),
            "t_rollout_s": round(self.t_rollout_s, 6),
            "makespan_s": round(self.makespan_s, 6),
            "solve_s": round(self.solve_s, 6),
        }

    def summary(self) -> str:
        lines = [
            f"cluster: {self.n_gpus} GPUs = {self.train_gpus} training + {self.rollout_gpus} rollout"
            + (f" + {self.idle_gpus} idle" if self.idle_gpus else ""),
            f"train:   {self.train_alloc()}  micro-batch {self.train.micro_batch}  T_train {self.t_train_s:.2f} s",
            f"rollout: {self.rollout_alloc()}  T_rollout {self.t_rollout_s:.2f} s",
            "buckets: " + ", ".join(f"<= {ln} -> TP{tp}" for ln, tp in self.buckets()),
            f"makespan {self.makespan_s:.2f} s per step (solved in {self.solve_s * 1000:.1f} ms)",
        ]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def explain(self) -> str:
        lines = [f"training decision tree on {self.train_gpus} GPUs (levels TP -> EP -> PP -> DP/micro-batch):"]
        for level in ("TP", "EP", "PP", "DP/mb"):
            recs = [r for r in self.tree_log if r.level == level]
            if recs:
                lines.append(f"  level {level}: {len(recs)} branch(es) pruned")
                lines += [f"    {r.branch}: {r.reason} [{r.kind}]" for r in recs]
        lines.append(f"  chosen: {self.train_alloc()} mb={self.train.micro_batch} -> {self.t_train_s:.3f} s "
                     + " ".join(f"{k}={v:.3g}" for k, v in self.train_breakdown.items() if k != "total"))
        lines.append("rollout DP interval assignment (sample sorted by final length):")
        for iv in self.intervals:
            lines.append(f"  samples [{iv.lo},{iv.hi}) lengths {iv.min_len}..{iv.max_len} ({iv.requests:.1f} requests)"
                         f" -> {iv.count} x TP{iv.tp}, {iv.t_s:.3f} s")
        return "\n".join(lines)
