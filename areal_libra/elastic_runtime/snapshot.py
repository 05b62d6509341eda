"""Versioned training snapshots: asynchronous publish, verified fetch, garbage collection.

A snapshot of version v is the training state after v optimizer steps (model, optimizer, lr scheduler,
anything the caller adds), one file per shard position (a replica with FSDP/TP/PP shards publishes one
file per rank position). Layout under `root`:

    v00000012_p0.pt     b"ELSNAP01" | u64 header length | header JSON | raw tensor bytes
                        header: {"version", "position", "meta": pickled state with tensors replaced by
                        indices (base64), "tensors": [{"dtype", "shape", "offset", "nbytes"}]}
    v00000012_p0.json   manifest {"version", "position", "bytes", "sha256"}; written last = published

Why not torch.save: pickling holds the GIL for the whole write, and the writer thread runs inside the
training process; raw buffer writes and sha256 updates release it, so the training step is not slowed.

Both are written to a temp name and os.replace'd, so a reader never sees a half-written file under the
final name; a truncated or foreign file is still refused because size, hash and version are checked.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pickle
import queue
import re
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from areal_libra.elastic_runtime.priority import enter_background
from areal_libra.utils import atomic_write_bytes

_NAME = re.compile(r"^v(\d{8})_p(\d+)\.json$")


class SnapshotError(RuntimeError):
    """A snapshot that must not be used (missing, truncated, corrupt, or of the wrong version)."""


def clone_state(obj: Any) -> Any:
    """Deep copy with detached tensor clones: what the background writer may read while training goes on."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_state(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(clone_state(v) for v in obj)
    return obj


_MAGIC = b"ELSNAP01"


class _TensorRef:
    def __init__(self, idx: int) -> None:
        self.idx = idx


def _split(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """Replace tensors by indices (tensors collected in order); everything else is small metadata."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _TensorRef(len(tensors) - 1)
    if isinstance(obj, dict):
        return {k: _split(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_split(v, tensors) for v in obj)
    return obj


def _join(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, _TensorRef):
        return tensors[obj.idx]
    if isinstance(obj, dict):
        return {k: _join(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_join(v, tensors) for v in obj)
    return obj


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def _write_snapshot(path: str, version: int, position: int, state: Any, digest: bool = True,
                    sync: bool = True) -> tuple[int, str]:
    """Atomic write; returns (bytes, sha256 or "" when digest=False).

    digest/sync=False for the gradient log: it lives only while a replica catches up, readers never
    see a partial file (os.replace) and a crash loses the join, not data; hashing and fsync would only
    burn the CPU time the training step needs."""
    tensors: list[torch.Tensor] = []
    meta = _split(state, tensors)
    specs, off = [], 0
    for t in tensors:
        nb = t.numel() * t.element_size()
        specs.append({"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "offset": off,
                      "nbytes": nb})
        off += nb
    header = json.dumps({"version": version, "position": position, "tensors": specs,
                         "meta": base64.b64encode(pickle.dumps(meta)).decode()}).encode()
    h = hashlib.sha256() if digest else None
    tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"
    with open(tmp, "wb") as f:
        for chunk in (_MAGIC, struct.pack("<Q", len(header)), header):
            f.write(chunk)
            if h is not None:
                h.update(chunk)
        for t in tensors:
            buf = _raw(t)
            f.write(buf)  # releases the GIL
            if h is not None:
                h.update(buf)  # hashlib releases the GIL for large buffers
        size = f.tell()
        if sync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    return size, h.hexdigest() if h is not None else ""


def _read_snapshot(data: bytearray) -> tuple[dict[str, Any], Any]:
    if data[:8] != _MAGIC:
        raise ValueError("not a snapshot file (bad magic)")
    (hlen,) = struct.unpack("<Q", data[8:16])
    header = json.loads(bytes(data[16:16 + hlen]))
    base = 16 + hlen
    tensors = []
    for sp in header["tensors"]:
        dtype = getattr(torch, sp["dtype"])
        if sp["nbytes"] == 0:
            tensors.append(torch.empty(sp["shape"], dtype=dtype))
            continue
        raw = torch.frombuffer(data, dtype=torch.uint8, count=sp["nbytes"], offset=base + sp["offset"])
        tensors.append(raw.view(dtype).reshape(sp["shape"]).clone())
    meta = pickle.loads(base64.b64decode(header["meta"]))
    return header, _join(meta, tensors)


@dataclass(frozen=True)
class SnapshotInfo:
    version: int
    position: int
    path: str
    manifest: str


class _Background:
    """One low-priority FIFO worker per store: snapshot writes, gradient-log writes and their garbage
    collection run in submission order (a gc never overtakes the write it follows), off the training
    thread and, with `priority.configure(cpus=...)`, off its CPU."""

    def __init__(self, name: str) -> None:
        self.q: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self.pending = 0
        self.errors: list[str] = []
        self.cv = threading.Condition()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        enter_background()
        while True:
            job = self.q.get()
            if job is None:
                return
            try:
                job()
            except Exception as e:  # noqa: BLE001 - one failed job must not stop the ones queued after it
                self.errors.append(str(e))
            finally:
                with self.cv:
                    self.pending -= 1
                    self.cv.notify_all()

    def submit(self, job: Callable[[], None]) -> None:
        with self.cv:
            self.pending += 1
        self.q.put(job)

    def drain(self, timeout: float | None = None) -> bool:
        with self.cv:
            return self.cv.wait_for(lambda: self.pending == 0, timeout)


class SnapshotStore:
    def __init__(self, root: str, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root = root
        self.keep = keep
        os.makedirs(root, exist_ok=True)
        self._clones: list[threading.Thread] = []
        self._bg: _Background | None = None
        self._bg_lock = threading.Lock()
        self.errors: list[str] = []

    def _paths(self, version: int, position: int) -> tuple[str, str]:
        base = os.path.join(self.root, f"v{version:08d}_p{position}")
        return base + ".pt", base + ".json"

    def _background(self) -> _Background:
        with self._bg_lock:  # clone threads call this concurrently: exactly one FIFO worker per store
            if self._bg is None:
                self._bg = _Background(f"snapshots-{os.path.basename(self.root)}")
            return self._bg

    # -- publish ---------------------------------------------------------------------------------
    def write(self, version: int, position: int, state: Any, corrupt: str | None = None) -> SnapshotInfo:
        """Synchronous write. `corrupt` ("truncate" | "wrong_version") exists for fault-injection tests."""
        pt, js = self._paths(version, position)
        payload_version = version + 1 if corrupt == "wrong_version" else version
        size, digest = _write_snapshot(pt, payload_version, position, state)
        if corrupt == "truncate":
            # Cut the payload after the manifest recorded its full size (as a crashed copy would be).
            with open(pt, "r+b") as f:
                f.truncate(size // 2)
        # wrong_version: a self-consistent file (size, hash) whose content belongs to another version.
        manifest = {"version": version, "position": position, "bytes": size, "sha256": digest}
        atomic_write_bytes(js, json.dumps(manifest).encode())
        self.gc(position)
        return SnapshotInfo(version, position, pt, js)

    def publish_async(
        self, version: int, position: int, state: Any, corrupt: str | None = None,
        on_done: Callable[[SnapshotInfo], None] | None = None,
    ) -> threading.Thread:
        """Clone on a helper thread, serialise and write on the low-priority background worker.

        The clone reads the live tensors, so the caller must call `fence()` before it next changes them
        (the optimizer step); forward/backward may run meanwhile. The clone keeps normal priority: the
        fence waits for it, and a starved clone would stall training (priority inversion)."""

        def write() -> None:
            try:
                info = self.write(version, position, cloned[0], corrupt)
                if on_done is not None:
                    on_done(info)
            except Exception as e:  # noqa: BLE001 - reported through .errors, training must go on
                self.errors.append(f"publish v{version} p{position}: {e}")

        cloned: list[Any] = []

        def clone() -> None:
            enter_background(lower=False)
            try:
                cloned.append(clone_state(state))
            except Exception as e:  # noqa: BLE001
                self.errors.append(f"publish v{version} p{position}: clone failed: {e}")
                return
            self._background().submit(write)

        t = threading.Thread(target=clone, name=f"snapshot-clone-v{version}-p{position}", daemon=True)
        t.start()
        self._clones = [x for x in self._clones if x.is_alive()] + [t]
        return t

    def fence(self, timeout: float | None = None) -> None:
        """Wait until every snapshot clone has read the live state (call before mutating it)."""
        for t in list(self._clones):
            t.join(timeout)
        self._clones = [x for x in self._clones if x.is_alive()]

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every clone and every background write/gc submitted so far."""
        self.fence(timeout)
        if self._bg is not None:
            self._bg.drain(timeout)

    # -- discover / fetch ------------------------------------------------------------------------
    def versions(self, position: int) -> list[int]:
        out = []
        for name in os.listdir(self.root):
            m = _NAME.match(name)
            if m and int(m.group(2)) == position:
                out.append(int(m.group(1)))
        return sorted(out)

    def latest(self, position: int, min_version: int = 0) -> int | None:
        vs = [v for v in self.versions(position) if v >= min_version]
        return vs[-1] if vs else None

    def fetch(self, version: int, position: int) -> Any:
        """Read, verify (size, sha256, version, position) and return the state; SnapshotError if unusable."""
        pt, js = self._paths(version, position)
        try:
            with open(js, "rb") as f:
                manifest = json.loads(f.read())
            with open(pt, "rb") as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                n = f.readinto(data)  # releases the GIL
                del data[n:]
        except FileNotFoundError as e:
            raise SnapshotError(f"snapshot v{version} p{position} missing (garbage-collected?): {e.filename}") from None
        except (OSError, ValueError) as e:
            raise SnapshotError(f"snapshot v{version} p{position} manifest unreadable: {e}") from None
        if len(data) != manifest.get("bytes"):
            raise SnapshotError(
                f"snapshot v{version} p{position} truncated: {len(data)} of {manifest.get('bytes')} bytes in {pt}")
        if hashlib.sha256(data).hexdigest() != manifest.get("sha256"):
            raise SnapshotError(f"snapshot v{version} p{position} checksum mismatch in {pt}")
        try:
            header, state = _read_snapshot(data)
        except Exception as e:  # noqa: BLE001 - any decoding failure means an unusable file
            raise SnapshotError(f"snapshot v{version} p{position} cannot be decoded: {e}") from None
        if header.get("version") != version or manifest.get("version") != version:
            raise SnapshotError(
                f"snapshot {pt} has wrong version: expected v{version}, file holds v{header.get('version')}")
        if header.get("position") != position:
            raise SnapshotError(f"snapshot {pt} is for position {header.get('position')}, expected {position}")
        return state

    # -- replay log: the reduced gradient of every step while a replica catches up -----------------
    def _grad_path(self, step: int, position: int) -> str:
        return os.path.join(self.root, f"g{step:08d}_p{position}.bin")

    def publish_grad_async(self, step: int, position: int, flat: torch.Tensor, owned: bool = False) -> None:
        """Log the committed reduced gradient of `step` (flat fp32) for replicas replaying to the present.
        owned=True: the caller hands the tensor over (never touches it again), so no copy is made."""
        data = flat if owned else flat.detach().clone()
        path = self._grad_path(step, position)

        def write() -> None:
            try:
                _write_snapshot(path, step, position, {"grad": data}, digest=False, sync=False)
            except Exception as e:  # noqa: BLE001 - reported through .errors
                self.errors.append(f"grad log {step} p{position}: {e}")

        self._background().submit(write)

    def gc_grads_async(self, position: int, below_oldest_snapshot: bool = True) -> None:
        """In the background, after the writes before it: drop logged gradients older than the oldest
        kept snapshot (a joiner starts from a snapshot), or all of them."""

        def gc() -> None:
            vs = self.versions(position) if below_oldest_snapshot else []
            if below_oldest_snapshot and not vs:
                return
            self.gc_grads(position, below=vs[0] if vs else None)

        self._background().submit(gc)

    def read_grad(self, step: int, position: int) -> torch.Tensor | None:
        """The logged gradient of `step`, or None while it is not (yet) on disk."""
        try:
            with open(self._grad_path(step, position), "rb") as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                del data[f.readinto(data):]
        except FileNotFoundError:
            return None
        header, state = _read_snapshot(data)
        if header["version"] != step or header["position"] != position:
            raise SnapshotError(f"gradient log {self._grad_path(step, position)} holds step {header['version']}")
        return state["grad"]

    def gc_grads(self, position: int, below: int | None = None) -> None:
        """Drop logged gradients of steps < below (all when below is None)."""
        for name in os.listdir(self.root):
            m = re.match(r"^g(\d{8})_p(\d+)\.bin$", name)
            if m and int(m.group(2)) == position and (below is None or int(m.group(1)) < below):
                try:
                    os.remove(os.path.join(self.root, name))
                except FileNotFoundError:
                    pass

    def gc(self, position: int) -> list[int]:
        """Delete all but the newest `keep` versions; a reader that already opened a file keeps its data."""
        vs = self.versions(position)
        dropped = vs[: max(0, len(vs) - self.keep)]
        for v in dropped:
            pt, js = self._paths(v, position)
            for p in (js, pt):  # manifest first: the version disappears before its payload does
                try:
                    os.remove(p)
                except FileNotFoundError:
                    pass
        return dropped
