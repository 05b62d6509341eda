"""Apply, check, revert and report the project's patches against AReaL 1.0.4.

    python -m areal_libra.patches apply|check|revert|status [--areal-dir DIR]

The patches in patches/areal-1.0.4/ are unified diffs with paths `a/areal/...`. They apply to the installed
`areal` package or to an AReaL source checkout (areal-project/AReaL@a0f3dca20). All patches are computed in
memory first: nothing is written unless every patch applies, and each file is replaced atomically.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from areal_libra.utils import atomic_write_text

PATCH_DIR = Path(__file__).resolve().parent.parent / "patches" / "areal-1.0.4"
_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(RuntimeError):
    """A patch that cannot be applied; the message names patch, file and hunk."""


@dataclass
class Hunk:
    header: str
    old_start: int
    old: list[str] = field(default_factory=list)
    new: list[str] = field(default_factory=list)


@dataclass
class FilePatch:
    path: str
    hunks: list[Hunk] = field(default_factory=list)


@dataclass
class Patch:
    name: str
    files: list[FilePatch]


def parse_patch(text: str, name: str = "<patch>") -> Patch:
    files: list[FilePatch] = []
    cur: FilePatch | None = None
    hunk: Hunk | None = None
    for line in text.splitlines(keepends=True):
        if line.startswith("--- "):
            hunk = None
            continue
        if line.startswith("+++ "):
            path = line[4:].strip().split("\t")[0]
            path = path[2:] if path.startswith("b/") else path
            cur = FilePatch(path)
            files.append(cur)
            continue
        m = _HUNK_RE.match(line)
        if m:
            if cur is None:
                raise PatchError(f"{name}: hunk before any file header")
            hunk = Hunk(header=line.strip(), old_start=int(m.group(1)))
            cur.hunks.append(hunk)
            continue
        if hunk is None or line.startswith("\\"):
            continue  # diff/index lines, "\ No newline at end of file"
        body = line[1:] if len(line) > 1 else "\n"
        if line.startswith(" ") or line == "\n":
            hunk.old.append(body)
            hunk.new.append(body)
        elif line.startswith("-"):
            hunk.old.append(body)
        elif line.startswith("+"):
            hunk.new.append(body)
    if not files:
        raise PatchError(f"{name}: no file changes found")
    return Patch(name, files)


def _find(lines: list[str], block: list[str], hint: int) -> int:
    """Index where block occurs in lines, the occurrence nearest to hint; -1 if absent."""
    n = len(block)
    if n == 0:
        return min(max(hint, 0), len(lines))
    best = -1
    for i in range(len(lines) - n + 1):
        if lines[i : i + n] == block and (best < 0 or abs(i - hint) < abs(best - hint)):
            best = i
    return best


def apply_file(content: str, fp: FilePatch, patch_name: str, reverse: bool = False) -> str:
    lines = content.splitlines(keepends=True)
    offset = 0
    for k, h in enumerate(fp.hunks, 1):
        old, new = (h.new, h.old) if reverse else (h.old, h.new)
        at = _find(lines, old, h.old_start - 1 + offset)
        if at < 0:
            raise PatchError(f"{patch_name}: {fp.path}: hunk {k} ({h.header}) does not apply")
        lines[at : at + len(old)] = new
        offset += len(new) - len(old)
    return "".join(lines)


def find_areal_root(areal_dir: str | None) -> Path:
    """The folder that contains the `areal` package (site-packages or a checkout root)."""
    if areal_dir:
        d = Path(areal_dir).resolve()
        if (d / "areal" / "__init__.py").is_file():
            return d
        if d.name == "areal" and (d / "__init__.py").is_file():
            return d.parent
        raise PatchError(f"{areal_dir}: not an AReaL checkout or package (no areal/__init__.py)")
    spec = importlib.util.find_spec("areal")
    if spec is None or not spec.origin:
        raise PatchError("the areal package is not installed (pip install --no-deps areal==1.0.4)")
    return Path(spec.origin).resolve().parent.parent


def load_patches(patch_dir: Path = PATCH_DIR) -> list[Patch]:
    files = sorted(patch_dir.glob("*.patch"))
    if not files:
        raise PatchError(f"{patch_dir}: no patches found")
    return [parse_patch(f.read_text(encoding="utf-8"), f.name) for f in files]


def _read(root: Path, rel: str, cache: dict[str, str]) -> str:
    if rel not in cache:
        p = root / rel
        if not p.is_file():
            raise PatchError(f"{rel}: file not found under {root}")
        cache[rel] = p.read_text(encoding="utf-8")
    return cache[rel]


def _try(patch: Patch, root: Path, state: dict[str, str], reverse: bool) -> tuple[dict[str, str] | None, str]:
    out: dict[str, str] = {}
    try:
        for fp in patch.files:
            src = out.get(fp.path) or _read(root, fp.path, state)
            out[fp.path] = apply_file(src, fp, patch.name, reverse=reverse)
    except PatchError as e:
        return None, str(e)
    return out, ""


def plan(root: Path, patches: list[Patch]) -> list[tuple[Patch, str, str, dict[str, str] | None]]:
    """For each patch in order: (patch, state, reason, files after apply), state in
    {'applied', 'applicable', 'conflict'}; later patches see earlier ones applied."""
    state: dict[str, str] = {}
    rows = []
    for p in patches:
        fwd, why = _try(p, root, state, reverse=False)
        if fwd is not None:
            rows.append((p, "applicable", "", fwd))
            state.update(fwd)
            continue
        back, _ = _try(p, root, state, reverse=True)
        if back is not None:
            rows.append((p, "applied", "", None))
        else:
            rows.append((p, "conflict", why, None))
    return rows


def apply(root: Path, patches: list[Patch]) -> list[str]:
    rows = plan(root, patches)
    bad = [why for _, st, why, _ in rows if st == "conflict"]
    if bad:
        raise PatchError(bad[0] + " (nothing was written)")
    final: dict[str, str] = {}
    for _, st, _, files in rows:
        if st == "applicable" and files:
            final.update(files)
    for rel, text in final.items():
        atomic_write_text(root / rel, text)  # keeps the file's permissions
    return [p.name for p, st, _, _ in rows if st == "applicable"]


def revert(root: Path, patches: list[Patch]) -> list[str]:
    rows = plan(root, patches)
    bad = [why for _, st, why, _ in rows if st == "conflict"]
    if bad:
        raise PatchError(bad[0] + " (nothing was written)")
    state: dict[str, str] = {}
    done = []
    for p, st, _, _ in reversed(rows):
        if st != "applied":
            continue
        files, why = _try(p, root, state, reverse=True)
        if files is None:
            raise PatchError(why + " (nothing was written)")
        state.update(files)
        done.append(p.name)
    for rel, text in state.items():
        atomic_write_text(root / rel, text)  # keeps the file's permissions
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m areal_libra.patches", description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=["apply", "check", "revert", "status"])
    ap.add_argument("--areal-dir", default=None, help="AReaL checkout or areal package dir (default: installed)")
    ap.add_argument("--patch-dir", default=str(PATCH_DIR), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        root = find_areal_root(args.areal_dir)
        patches = load_patches(Path(args.patch_dir))
        if args.command == "apply":
            done = apply(root, patches)
            print(f"applied {len(done)} patch(es) to {root / 'areal'}" + (f": {', '.join(done)}" if done else
                  " (all already applied)"))
            return 0
        if args.command == "revert":
            done = revert(root, patches)
            print(f"reverted {len(done)} patch(es) in {root / 'areal'}")
            return 0
        rows = plan(root, patches)
        for p, st, why, _ in rows:
            print(f"{st:10s} {p.name}" + (f"  -- {why}" if why else ""))
        conflicts = [r for r in rows if r[1] == "conflict"]
        if args.command == "check" and conflicts:
            print(f"check failed: {len(conflicts)} patch(es) do not apply to {root / 'areal'}", file=sys.stderr)
            return 1
        return 0
    except (PatchError, OSError, UnicodeDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
