"""Small shared helpers: atomic writes, free ports, process liveness."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile
from pathlib import Path


def cache_root() -> Path:
    """$AREAL_LIBRA_CACHE, else ~/.cache/areal_libra: the project's caches (models, AReaL's config keys)."""
    env = os.environ.get("AREAL_LIBRA_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "areal_libra"


def first_line(e: BaseException) -> str:
    """An exception as one line for the user: its message's first line, or its type when it has none."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write bytes to path atomically (temp file in the same folder, fsync, rename). A file that exists
    keeps its permissions (e.g. a patched source file of an installed package); a new one is private (0600)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileNotFoundError):
            os.chmod(tmp, p.stat().st_mode & 0o777)
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write text (UTF-8) to path atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


def append_jsonl(path: str | os.PathLike, record: dict) -> None:
    """Append one JSON object as a line; a single write() so readers never see half a line."""
    line = json.dumps(record, separators=(",", ":"), default=float) + "\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)
        f.flush()


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Every JSON object of a JSONL file, oldest first; a missing file is empty, a bad line (one cut by a kill)
    is skipped."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports that were free a moment ago (all held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    """One port that was free a moment ago."""
    return free_ports(1, host)[0]


def pid_alive(pid: int) -> bool:
    """Whether pid is a live process: a zombie (exited, its parent has not reaped it yet) counts as dead, one
    owned by another user as alive. From /proc where there is one, else signal 0."""
    if os.path.isdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
