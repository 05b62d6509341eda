"""Rollout groups: several server groups of different TP serving one model (Libra's heterogeneous fleet).

A group is `count` servers of tensor-parallel size `tp`; it serves the dispatcher's bucket of trajectories
up to `max_len` tokens (groups ascend by max_len, so larger TP serves longer trajectories). Groups come
from the config (`libra.rollout_groups`, a list), from an allocation string (`sglang:d2t1+d1t2+d1t4`:
two TP1 servers, one TP2, one TP4) or from the planner's Plan. This module also places servers on GPUs:
contiguous TP-aligned GPU blocks on one node (local scheduler) or one Ray placement group per server
with `tp` GPUs packed on one node.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, is_dataclass, replace
from typing import Any

BACKENDS = ("sglang", "vllm", "embedded")
_TERM = re.compile(r"^(?:([dt])(\d+))(?:([dt])(\d+))?$")


class GroupConfigError(ValueError):
    """A rollout-group configuration or allocation string that cannot be used (one-line message)."""


@dataclass(frozen=True)
class RolloutGroup:
    name: str
    tp: int = 1
    count: int = 1
    threads: int = 0  # embedded CPU server: compute threads; 0 = tp (a "TP t" CPU server runs t threads)
    max_running: int = 256  # batch capacity per server
    max_len: int = 0  # bucket threshold in tokens (0: assigned by assign_buckets)

    def __post_init__(self) -> None:
        if not self.threads:
            object.__setattr__(self, "threads", self.tp)

    @property
    def gpus(self) -> int:
        return self.tp * self.count


def _pos_int(value: object, what: str) -> int:
    try:
        v = int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise GroupConfigError(f"{what} must be a positive integer, got {value!r}") from None
    if v <= 0 or (isinstance(value, float) and value != v):
        raise GroupConfigError(f"{what} must be a positive integer, got {value!r}")
    return v


# --- allocation strings -------------------------------------------------------------------------------


def parse_allocation(spec: str) -> tuple[str, list[RolloutGroup]]:
    """`sglang:d2t1+d1t2+d1t4` -> ("sglang", [2 x TP1, 1 x TP2, 1 x TP4]); d or t may be omitted (=1)."""
    if not isinstance(spec, str) or ":" not in spec:
        raise GroupConfigError(f"allocation {spec!r} must look like BACKEND:d2t1+d1t2 (e.g. sglang:d2t1+d1t2)")
    backend, _, body = spec.strip().partition(":")
    if backend not in BACKENDS:
        raise GroupConfigError(f"allocation {spec!r}: unknown backend {backend!r} (use {', '.join(BACKENDS)})")
    groups: list[RolloutGroup] = []
    seen: set[int] = set()
    for term in body.split("+"):
        m = _TERM.match(term.strip())
        if not m or (m.group(3) is not None and m.group(1) == m.group(3)):
            raise GroupConfigError(f"allocation {spec!r}: bad term {term!r} (expected d<servers>t<tp>)")
        dims = {m.group(1): int(m.group(2))}
        if m.group(3):
            dims[m.group(3)] = int(m.group(4))
        count, tp = dims.get("d", 1), dims.get("t", 1)
        if count <= 0 or tp <= 0:
            raise GroupConfigError(f"allocation {spec!r}: term {term!r} needs positive sizes")
        if tp in seen:
            raise GroupConfigError(f"allocation {spec!r}: TP{tp} appears twice (merge it into one term)")
        seen.add(tp)
        groups.append(RolloutGroup(name=f"tp{tp}", tp=tp, count=count, threads=tp))
    return backend, sorted(groups, key=lambda g: g.tp)


def format_allocation(backend: str, groups: Iterable[RolloutGroup]) -> str:
    """Inverse of parse_allocation (groups of equal TP merge; ascending TP)."""
    counts: dict[int, int] = {}
    for g in groups:
        counts[g.tp] = counts.get(g.tp, 0) + g.count
    if not counts:
        raise GroupConfigError("no rollout groups to format")
    return f"{backend}:" + "+".join(f"d{c}t{tp}" for tp, c in sorted(counts.items()))


# --- configuration ------------------------------------------------------------------------------------


def assign_buckets(groups: Sequence[RolloutGroup], max_tokens: int) -> list[RolloutGroup]:
    """Order groups from short to long and give every group without a threshold one.

    Without thresholds the token range (0, max_tokens] is split evenly in group order, ascending TP (the
    smallest servers take the shortest trajectories). Thresholds must end up strictly ascending; the last
    group also serves anything longer than its threshold.
    """
    if not groups:
        raise GroupConfigError("at least one rollout group is needed")
    max_tokens = _pos_int(max_tokens, "max_tokens")
    ordered = (
        sorted(groups, key=lambda g: (g.max_len or 0, g.tp))
        if all(g.max_len for g in groups)
        else sorted(groups, key=lambda g: g.tp)
    )
    n = len(ordered)
    out = []
    for i, g in enumerate(ordered):
        ml = g.max_len or max(1, round(max_tokens * (i + 1) / n))
        out.append(replace(g, max_len=ml))
    th = [g.max_len for g in out]
    if th != sorted(set(th)):
        raise GroupConfigError(f"rollout group thresholds must be strictly ascending, got {th}")
    names = [g.name for g in out]
    if len(set(names)) != len(names):
        raise GroupConfigError(f"rollout group names must be unique, got {names}")
    return out


def group_from_mapping(d: Mapping, index: int) -> RolloutGroup:
    known = {"name", "tp", "count", "threads", "max_running", "max_len"}
    extra = set(d) - known
    if extra:
        raise GroupConfigError(f"rollout_groups[{index}]: unknown key(s) {', '.join(sorted(extra))}")
    tp = _pos_int(d.get("tp", 1), f"rollout_groups[{index}].tp")
    return RolloutGroup(
        name=str(d.get("name") or f"tp{tp}"),
        tp=tp,
        count=_pos_int(d.get("count", 1), f"rollout_groups[{index}].count"),
        # threads default to tp: on CPU a "TP t" server gets t compute threads (an explicit value wins)
        threads=_pos_int(d.get("threads") or tp, f"rollout_groups[{index}].threads"),
        max_running=_pos_int(d.get("max_running", 256), f"rollout_groups[{index}].max_running"),
        max_len=int(d.get("max_len") or 0),
    )


def resolve_groups(libra: Mapping, max_tokens: int) -> list[RolloutGroup]:
    """The run's groups: `libra.rollout_alloc` (allocation string) wins over `libra.rollout_groups`."""
    def get(key: str) -> Any:  # a mapping (DictConfig, dict) or the typed LibraConfig
        return libra.get(key) if isinstance(libra, Mapping) else getattr(libra, key)

    alloc = get("rollout_alloc")
    if alloc:
        _, groups = parse_allocation(str(alloc))
    else:
        raw = get("rollout_groups") or []
        groups = [group_from_mapping(asdict(g) if is_dataclass(g) else dict(g), i) for i, g in enumerate(raw)]
    return assign_buckets(groups, max_tokens)


def groups_from_plan(plan) -> list[RolloutGroup]:
    """One group per distinct TP of a planner Plan, thresholds from its DP intervals (ascending)."""
    counts = dict(plan.tp_counts())
    reach: dict[int, int] = {}
    for inst in plan.instances:
        reach[inst.tp] = max(reach.get(inst.tp, 0), int(inst.max_len))
    groups, last = [], 0
    # The DP gives larger TP to longer intervals; force strictly ascending thresholds in TP order.
    for tp in sorted(counts):
        ml = max(reach[tp], last + 1)
        groups.append(RolloutGroup(name=f"tp{tp}", tp=tp, count=counts[tp], threads=tp, max_len=ml))
        last = ml
    return groups


def expand_servers(groups: Sequence[RolloutGroup]) -> list[RolloutGroup]:
    """One entry per server, in launch (= address) order: group after group."""
    return [g for g in groups for _ in range(g.count)]


def server_sizes(groups: Sequence[RolloutGroup]) -> list[int]:
    """GPUs (TP ranks) of every server in address order: what xccl rank offsets sum."""
    return [g.tp for g in expand_servers(groups)]


def xccl_rank_offsets(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Rank offset of each server in the weight-update group and the group's world size: the trainer
    is rank 0, server i's TP ranks start at 1 + the sizes of the servers before it."""
    offs, acc = [], 1
    for s in sizes:
        offs.append(acc)
        acc += _pos_int(s, "server size")
    return offs, acc


# --- GPU placement ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerPlacement:
    group: str
    tp: int
    gpus: tuple[int, ...]

    @property
    def cuda_visible_devices(self) -> str:
        return ",".join(str(g) for g in self.gpus)


def place_local(groups: Sequence[RolloutGroup], n_gpus: int, first_gpu: int = 0) -> list[ServerPlacement]:
    """GPU ids per server on one node, in address order. Each server gets a block of `tp` GPUs aligned to
    a multiple of `tp` (keeps a TP group inside one NVLink/PCIe switch domain); larger servers are placed
    first so alignment never strands GPUs, then results are returned in address order."""
    servers = list(enumerate(expand_servers(groups)))
    need = sum(g.tp for _, g in servers)
    if first_gpu < 0 or need > n_gpus - first_gpu:
        raise GroupConfigError(
            f"rollout groups need {need} GPUs, only {max(0, n_gpus - first_gpu)} available "
            f"(GPUs {first_gpu}..{n_gpus - 1})"
        )
    free = [True] * n_gpus
    for i in range(first_gpu):
        free[i] = False
    placed: dict[int, ServerPlacement] = {}
    for idx, g in sorted(servers, key=lambda ig: (-ig[1].tp, ig[0])):
        start = next((s for s in range(0, n_gpus - g.tp + 1, g.tp) if all(free[s : s + g.tp])), None)
        if start is None:
            raise GroupConfigError(f"cannot place a TP{g.tp} server on an aligned block of {g.tp} free GPUs")
        for k in range(start, start + g.tp):
            free[k] = False
        placed[idx] = ServerPlacement(g.name, g.tp, tuple(range(start, start + g.tp)))
    return [placed[i] for i in range(len(servers))]


def ray_bundles(groups: Sequence[RolloutGroup], cpus_per_server: int = 1) -> list[list[dict[str, float]]]:
    """Ray placement-group bundles per server (address order): one bundle of `tp` GPUs, to be created with
    strategy STRICT_PACK so all TP ranks of a server sit on one node."""
    return [[{"GPU": float(g.tp), "CPU": float(cpus_per_server)}] for g in expand_servers(groups)]


def create_ray_placement_groups(groups: Sequence[RolloutGroup], cpus_per_server: int = 1, timeout_s: float = 60.0):
    """Create (and wait for) one STRICT_PACK placement group per server; returns them in address order.
    Raises GroupConfigError when the cluster cannot host them in time (placement groups are removed)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    pgs = [
        placement_group(b, strategy="STRICT_PACK", name=f"rollout-{i}-{g.name}")
        for i, (b, g) in enumerate(zip(ray_bundles(groups, cpus_per_server), expand_servers(groups)))
    ]
    ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=timeout_s)
    if len(ready) != len(pgs):
        for pg in pgs:
            remove_placement_group(pg)
        raise GroupConfigError(
            f"Ray could not place {len(pgs) - len(ready)} of {len(pgs)} rollout servers "
            f"within {timeout_s:.0f}s (need {sum(server_sizes(groups))} GPUs)"
        )
    return pgs
