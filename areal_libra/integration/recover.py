"""Resuming a run with AReaL's recover (recover.mode=auto|resume, recover.freq_steps=N).

AReaL checkpoints the actor, optimizer and data loader every N steps and, on a restart with the same
experiment and trial names, loads the last checkpoint and pushes its weights to the servers. Around it,
this project restores its own state:

- the launcher clears the trial's name_resolve records first (a killed trainer leaves its weight-update
  entries behind, and the restarted one's first weight update would then fail on an existing entry), and
  keeps metrics.jsonl up to the recovered step instead of starting a fresh one, so the reward curve
  continues (steps after the checkpoint are trained again and logged again);
- the router reloads the live prefix tree from the run directory (router.build_router, restore=True);
- the control loop's length history (what the planner plans from) is saved every step to
  <run_dir>/control_state.json and reloaded, so the first plan after the restart is made from the same
  history as before instead of waiting for new profile steps.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from areal_libra.utils import atomic_write_text

CONTROL_STATE = "control_state.json"


def recover_enabled(areal_cfg: Any) -> bool:
    return str(areal_cfg.recover.mode) in ("auto", "resume")


def recovered_steps(areal_cfg: Any) -> int | None:
    """Steps the last recover checkpoint holds (AReaL resumes after them), or None when there is none."""
    if not recover_enabled(areal_cfg):
        return None
    import getpass

    c = areal_cfg
    path = (Path(str(c.recover.fileroot)) / "checkpoints" / getpass.getuser() / str(c.recover.experiment_name)
            / str(c.recover.trial_name) / "recover_info" / "step_info.json")
    try:
        return int(json.loads(path.read_text())["global_step"]) + 1
    except (OSError, ValueError, KeyError, TypeError):
        return None


def clear_name_resolve(areal_cfg: Any) -> None:
    """Remove the trial's name_resolve records (as AReaL's own launchers do before a run starts)."""
    from areal.utils import name_resolve, names

    name_resolve.reconfigure(areal_cfg.cluster.name_resolve)
    name_resolve.clear_subtree(names.trial_root(str(areal_cfg.experiment_name), str(areal_cfg.trial_name)))


def trim_metrics(path: Path, steps: int) -> int:
    """Keep the records of steps 1..steps (the rest is trained again); how many were kept."""
    if not path.exists():
        return 0
    keep = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            break  # a record cut by the kill
        if int(rec.get("step", 0)) <= steps:
            keep.append(line)
    atomic_write_text(path, "".join(x + "\n" for x in keep))
    return len(keep)


def save_control_state(run_dir: Path, step: int, cluster: Any) -> None:
    """The control loop's inputs worth keeping across a restart: the finished lengths history."""
    body = {"step": step, "finished": [list(x) for x in cluster.finished]}
    atomic_write_text(Path(run_dir) / CONTROL_STATE, json.dumps(body) + "\n")


def restore_control_state(run_dir: Path, cluster: Any) -> int:
    """Reload the saved history into `cluster` (a LiveCluster); how many entries were restored."""
    p = Path(run_dir) / CONTROL_STATE
    try:
        body = json.loads(p.read_text())
        items = [(int(a), int(b)) for a, b in body["finished"]]
    except (OSError, ValueError, KeyError, TypeError):
        return 0
    cluster.finished.extend(items)
    # stdout (trainer.log), like the control loop's own decisions
    print(f"areal_libra recover: restored {len(items)} finished lengths (control history of step "
          f"{body.get('step')})", flush=True)
    return len(items)
