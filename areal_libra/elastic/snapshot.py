"""Versioned training snapshots: asynchronous publish, verified fetch, garbage collection.

A snapshot of version v is the training state after v optimizer steps (model, optimizer, lr scheduler,
anything the caller adds), one file per shard position (a replica with FSDP/TP/PP shards publishes one
file per rank position). Layout under `root`:

    v00000012_p0.pt     torch.save payload {"version", "position", "state"}
    v00000012_p0.json   manifest {"version", "position", "bytes", "sha256"}; written last = published

Both are written to a temp name and os.replace'd, so a reader never sees a half-written file under the
final name; a truncated or foreign file is still refused because size, hash and version are checked.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

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


def _atomic_write(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclass(frozen=True)
class SnapshotInfo:
    version: int
    position: int
    path: str
    manifest: str


class SnapshotStore:
    def __init__(self, root: str, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root = root
        self.keep = keep
        os.makedirs(root, exist_ok=True)
        self._threads: list[threading.Thread] = []
        self.errors: list[str] = []

    def _paths(self, version: int, position: int) -> tuple[str, str]:
        base = os.path.join(self.root, f"v{version:08d}_p{position}")
        return base + ".pt", base + ".json"

    # -- publish ---------------------------------------------------------------------------------
    def write(self, version: int, position: int, state: Any, corrupt: str | None = None) -> SnapshotInfo:
        """Synchronous write. `corrupt` ("truncate" | "wrong_version") exists for fault-injection tests."""
        buf = io.BytesIO()
        payload_version = version + 1 if corrupt == "wrong_version" else version
        torch.save({"version": payload_version, "position": position, "state": state}, buf)
        data = buf.getvalue()
        manifest = {"version": version, "position": position, "bytes": len(data),
                    "sha256": hashlib.sha256(data).hexdigest()}
        if corrupt == "truncate":
            data = data[: len(data) // 2]
        elif corrupt == "wrong_version":
            # A self-consistent file whose content belongs to another version: only the version check catches it.
            manifest["bytes"] = len(data)
            manifest["sha256"] = hashlib.sha256(data).hexdigest()
        pt, js = self._paths(version, position)
        _atomic_write(pt, data)
        _atomic_write(js, json.dumps(manifest).encode())
        self.gc(position)
        return SnapshotInfo(version, position, pt, js)

    def publish_async(
        self, version: int, position: int, state: Any, corrupt: str | None = None,
        on_done: Callable[[SnapshotInfo], None] | None = None,
    ) -> threading.Thread:
        """Clone now (cheap, on the training thread), serialise and write on a background thread."""
        cloned = clone_state(state)

        def run() -> None:
            try:
                info = self.write(version, position, cloned, corrupt)
                if on_done is not None:
                    on_done(info)
            except Exception as e:  # noqa: BLE001 - reported through .errors, training must go on
                self.errors.append(f"publish v{version} p{position}: {e}")

        t = threading.Thread(target=run, name=f"snapshot-v{version}-p{position}", daemon=True)
        t.start()
        self._threads = [x for x in self._threads if x.is_alive()] + [t]
        return t

    def wait(self, timeout: float | None = None) -> None:
        for t in list(self._threads):
            t.join(timeout)

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
                data = f.read()
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
            payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
        except Exception as e:  # noqa: BLE001 - any unpickling failure means an unusable file
            raise SnapshotError(f"snapshot v{version} p{position} cannot be decoded: {e}") from None
        if payload.get("version") != version or manifest.get("version") != version:
            raise SnapshotError(
                f"snapshot {pt} has wrong version: expected v{version}, file holds v{payload.get('version')}")
        if payload.get("position") != position:
            raise SnapshotError(f"snapshot {pt} is for position {payload.get('position')}, expected {position}")
        return payload["state"]

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
