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
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

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
    """One shard position's view of the domain: member `me` among `members` at `epoch`.

    `prepare(epoch, members)` starts the rendezvous of the next epoch's group on a helper thread (over
    its own store connection from `store_factory`), so that a membership change announced at the start
    of a step is ready by the time the step's gradients are; `rebuild` then adopts it instead of
    building on the training thread.
    """

    def __init__(
        self, store: dist.Store, position: int, me: str, timeout_s: float = 10.0,
        chunk_elems: int = 1 << 22, backend: str = "gloo", namespace: str = "dom",
        store_factory: Callable[[], dist.Store] | None = None,
    ) -> None:
        self.store = store
        self.store_factory = store_factory
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
        self.last_rebuild_wait_s = 0.0
        self.device = torch.device("cuda" if backend == "nccl" else "cpu")
        self._prep: tuple[int, tuple[str, ...], threading.Thread, list[Any]] | None = None

    @property
    def size(self) -> int:
        return len(self.members)

    def _build(self, store: dist.Store, epoch: int, members: tuple[str, ...]) -> Any:
        return make_group(store, f"{self.namespace}/{epoch}/p{self.position}/", members.index(self.me),
                          len(members), self.timeout_s, self.backend)

    def prepare(self, epoch: int, members: Sequence[str]) -> None:
        """Start building the group of (epoch, members) in the background (no-op without a store_factory)."""
        members = tuple(members)
        if self.store_factory is None or self.me not in members or epoch == self.epoch:
            return
        if self._prep is not None and self._prep[0] == epoch:
            return
        box: list[Any] = []
        factory = self.store_factory

        def build() -> None:
            try:
                # A connection per rendezvous: an abandoned one (its step failed) may still block in it.
                box.append(self._build(factory(), epoch, members))
            except Exception as e:  # noqa: BLE001 - surfaced by rebuild()
                box.append(e)

        t = threading.Thread(target=build, name=f"domain-prepare-{epoch}", daemon=True)
        t.start()
        self._prep = (epoch, members, t, box)

    def rebuild(self, epoch: int, members: Sequence[str], abort: Callable[[], str | None] | None = None) -> None:
        """Join the group of `epoch`; every member must call this with the same (epoch, members).

        While waiting for a prepared rendezvous, `abort()` is polled: a non-empty answer (e.g. "h0
        stopped beating") fails the rebuild at once instead of after the gloo timeout."""
        if self.me not in members:
            raise ValueError(f"{self.me} is not a member of epoch {epoch}: {list(members)}")
        self.close()
        self.members = tuple(members)
        self.epoch = epoch
        t0 = time.perf_counter()
        prep, self._prep = self._prep, None
        try:
            if prep is not None and prep[0] == epoch and prep[1] == self.members:
                deadline = time.monotonic() + self.timeout_s + 5.0
                while prep[2].is_alive() and time.monotonic() < deadline:
                    prep[2].join(0.1)
                    why = abort() if abort is not None and prep[2].is_alive() else None
                    if why:
                        raise TimeoutError(f"rendezvous abandoned: {why}")
                if not prep[3]:
                    raise TimeoutError("background rendezvous did not finish")
                if isinstance(prep[3][0], Exception):
                    raise prep[3][0]
                self.group = prep[3][0]
            else:
                self.group = self._build(self.store, epoch, self.members)
        except Exception as e:  # noqa: BLE001 - any rendezvous failure is a domain failure
            self.group = None
            raise DomainError(f"rebuilding domain epoch {epoch} failed: {e}") from e
        finally:
            self.last_rebuild_wait_s = time.perf_counter() - t0
        self.rebuilds += 1

    def close(self) -> None:
        # Dropping the reference is enough to release a gloo group; a broken group cannot be shut down cleanly.
        self.group = None

    def reduce_flat(self, tensors: Sequence[torch.Tensor], weight: float, numel: int | None = None
                    ) -> tuple[torch.Tensor, float]:
        """All-reduce without touching `tensors`: returns (flat fp32 sum_r w_r t_r / sum_r w_r, sum_r w_r).

        weight == 0 means "send zeros" (joining replica): `tensors` are not read and may be empty when
        `numel` gives the size. Leaving the inputs intact is what makes a failed step retryable without
        keeping a copy of the gradients; the returned buffer is fresh, so it can be handed on (the
        gradient log) without another copy.
        """
        if self.group is None:
            raise DomainError("domain has no group (not built or broken)")
        t0 = time.perf_counter()
        n = flat_size(tensors) if numel is None else numel
        if weight != 0:
            flat = torch.empty(n + 1, dtype=torch.float32, device=self.device)
            off = 0
            for t in tensors:
                k = t.numel()
                if t.dtype == torch.float32:
                    torch.mul(t.reshape(-1), weight, out=flat[off:off + k])  # one pass: copy and scale
                else:
                    flat[off:off + k].copy_(t.reshape(-1)).mul_(weight)  # scale in fp32, as for fp32
                off += k
        else:
            flat = torch.zeros(n + 1, dtype=torch.float32, device=self.device)
        flat[n] = float(weight)
        if len(self.members) > 1:  # alone in the domain the sum is the buffer itself
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
        out = flat[:n].div_(total)
        self.last_reduce_s = time.perf_counter() - t0
        return out, total

    @staticmethod
    def scatter(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
        off = 0
        for t in tensors:
            k = t.numel()
            t.copy_(flat[off:off + k].view_as(t))
            off += k

    def reduce(self, tensors: Sequence[torch.Tensor], weight: float) -> float:
        """In place: tensors <- sum_r w_r t_r / sum_r w_r over the members; returns sum_r w_r."""
        flat, total = self.reduce_flat(tensors, weight)
        self.scatter(flat, tensors)
        return total
