"""The cross-replica gradient domain: a process group of its own, rebuilt on membership changes.

Normalisation (what `GradientDomain.reduce` computes, per shard position):

    g = sum_r w_r * g_r / sum_r w_r

where g_r is replica r's gradient (already averaged over r's own data and its internal DP ranks) and
w_r is the amount of data behind it (samples or tokens; a hybrid replica with the same batch as a core
replica has the same weight). A replica that is still joining contributes w_r = 0 and g_r = 0, which
adds exact zeros to both sums: the result is bitwise what the other members alone would compute, i.e.
"this replica has not joined". The weight travels as the last element of the flat buffer, so members
never have to agree on weights beforehand.

The group is built straight from a store prefix (ProcessGroupGloo / ProcessGroupNCCL), not through
torch.distributed's default world, so members can come and go without touching the core groups.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist


class DomainError(RuntimeError):
    """A collective or rebuild of the domain failed (peer died, timed out)."""


def make_group(store: dist.Store, prefix: str, rank: int, size: int, timeout_s: float, backend: str = "gloo"):
    """A standalone process group over `store` under `prefix` (unique per epoch and position)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    pstore = dist.PrefixStore(prefix, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(pstore, rank, size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(pstore, rank, size, opts)
    raise ValueError(f"unknown backend {backend!r} (gloo or nccl)")


def flat_size(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() for t in tensors)


class GradientDomain:
    """One shard position's view of the domain: member `me` among `members` at `epoch`."""

    def __init__(
        self, store: dist.Store, position: int, me: str, timeout_s: float = 10.0,
        chunk_elems: int = 1 << 22, backend: str = "gloo", namespace: str = "dom",
    ) -> None:
        self.store = store
        self.position = position
        self.me = me
        self.timeout_s = timeout_s
        self.chunk_elems = chunk_elems
        self.backend = backend
        self.namespace = namespace
        self.epoch: int | None = None
        self.members: tuple[str, ...] = ()
        self.group = None
        self.rebuilds = 0
        self.last_reduce_s = 0.0
        self.device = torch.device("cuda" if backend == "nccl" else "cpu")

    @property
    def size(self) -> int:
        return len(self.members)

    def rebuild(self, epoch: int, members: Sequence[str]) -> None:
        """Join the group of `epoch`; every member must call this with the same (epoch, members)."""
        if self.me not in members:
            raise ValueError(f"{self.me} is not a member of epoch {epoch}: {list(members)}")
        self.close()
        self.members = tuple(members)
        self.epoch = epoch
        try:
            self.group = make_group(self.store, f"{self.namespace}/{epoch}/p{self.position}/",
                                    self.members.index(self.me), len(self.members), self.timeout_s, self.backend)
        except Exception as e:  # noqa: BLE001 - any rendezvous failure is a domain failure
            self.group = None
            raise DomainError(f"rebuilding domain epoch {epoch} failed: {e}") from e
        self.rebuilds += 1

    def close(self) -> None:
        # Dropping the reference is enough to release a gloo group; a broken group cannot be shut down cleanly.
        self.group = None

    def reduce(self, tensors: Sequence[torch.Tensor], weight: float) -> float:
        """In place: tensors <- sum_r w_r t_r / sum_r w_r over the members; returns sum_r w_r.

        weight == 0 means "send zeros" (joining replica): the local tensors are not read, and receive
        the members' weighted mean like everyone else.
        """
        if self.group is None:
            raise DomainError("domain has no group (not built or broken)")
        t0 = time.perf_counter()
        n = flat_size(tensors)
        flat = torch.zeros(n + 1, dtype=torch.float32, device=self.device)
        if weight != 0:
            off = 0
            for t in tensors:
                k = t.numel()
                flat[off:off + k].copy_(t.reshape(-1)).mul_(weight)
                off += k
        flat[n] = float(weight)
        try:
            works = [self.group.allreduce([flat[i:i + self.chunk_elems]])
                     for i in range(0, n + 1, self.chunk_elems)]
            for w in works:
                w.wait()
        except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError subclasses on dead peers and timeouts
            self.group = None
            raise DomainError(f"all-reduce in domain epoch {self.epoch} failed: {e}") from e
        total = float(flat[n])
        if total <= 0:
            raise DomainError(f"domain epoch {self.epoch}: total data weight {total} (no active member)")
        flat = flat[:n].div_(total)
        off = 0
        for t in tensors:
            k = t.numel()
            t.copy_(flat[off:off + k].view_as(t))
            off += k
        self.last_reduce_s = time.perf_counter() - t0
        return total
