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
  history as before instead of waiting for new profile steps;
- in the same file, per step (the last KEEP steps): the LibraController's decision state (its plan, measured
  windows, persistence verdicts, last re-plan/change steps, cooldown trigger, counters) and the elastic
  pool's (which hybrids were training, its counters). On resume the snapshot of the checkpoint's step is
  restored (AReaL trains the steps after it again), the rollout layout is brought back to the saved plan,
  and hybrids that were training re-join through the ordinary join protocol once their restarted workers
  are ready (a restarted worker holds no weights, so it cannot simply be marked training).
A missing or unreadable state is one printed line and a fresh start, never a crash.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from areal_libra.cost.training import TrainParallel
from areal_libra.planner.types import Plan, RolloutInstance
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


# Per-step records of a run: on a resume the steps after the checkpoint are trained (and decided) again.
STEP_RECORDS = ("metrics.jsonl", "control_events.jsonl")


def trim_step_records(path: Path, steps: int) -> int:
    """Keep the records of steps up to ``steps`` (the rest is trained again); how many were kept."""
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


def reset_step_records(run_dir: Path, resumed: int | None) -> str:
    """Before the trainer starts: a resume keeps the per-step records up to the checkpoint's step, a fresh
    run (a re-used trial name) starts them empty. Returns what was kept, e.g. 'metrics.jsonl keeps 6'."""
    kept = []
    for name in STEP_RECORDS:
        if resumed:
            kept.append(f"{name} keeps {trim_step_records(run_dir / name, resumed)}")
        else:
            (run_dir / name).unlink(missing_ok=True)
    return ", ".join(kept)


KEEP = 64  # per-step snapshots kept: covers any recover.freq_steps up to it


def plan_to_state(plan: Any) -> dict[str, Any]:
    """A planner Plan as JSON (what the controller and the layout need; not the solver's explanations)."""
    return {"train": asdict(plan.train), "rollout_gpus": plan.rollout_gpus,
            "instances": [asdict(i) for i in plan.instances], "t_train_s": plan.t_train_s,
            "t_rollout_s": plan.t_rollout_s, "makespan_s": plan.makespan_s, "solve_s": plan.solve_s,
            "n_gpus": plan.n_gpus, "train_backend": plan.train_backend, "rollout_backend": plan.rollout_backend,
            "idle_gpus": plan.idle_gpus, "notes": list(plan.notes)}


def plan_from_state(d: dict[str, Any]) -> Any:

    try:
        return Plan(**{**d, "train": TrainParallel(**d["train"]),
                       "instances": [RolloutInstance(**i) for i in d["instances"]]})
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"bad plan state: {e!r}") from None


class ControlStateFile:
    """<run_dir>/control_state.json: the length history, the controller's events, and per step the controller's
    and the elastic pool's state; one atomic write per step."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / CONTROL_STATE
        self.snapshots: dict[int, dict[str, Any]] = {}

    def save(self, step: int, cluster: Any, control: Any = None) -> None:
        ctl = getattr(control, "ctl", None)
        pool = getattr(getattr(getattr(cluster, "elastic", None), "core", None), "pool", None)
        self.snapshots[step] = {
            "plan": plan_to_state(ctl.plan) if ctl is not None else None,
            "controller": ctl.to_state() if ctl is not None else None,
            "pool": pool.to_state() if pool is not None else None}
        for s in sorted(self.snapshots)[:-KEEP]:
            del self.snapshots[s]
        cohorts = getattr(cluster, "cohorts", None)
        keep = (cohorts.needed(int(cluster.finished.maxlen or len(cluster.finished)), cluster.running_fn())
                if cohorts is not None else {})
        body = {"step": step, "finished": [list(x) for x in cluster.finished],
                "cohorts": [[v, [list(r) for r in rows]] for v, rows in sorted(keep.items())],
                "events": [[e.step, e.kind, e.detail] for e in (ctl.events if ctl is not None else [])],
                "snapshots": {str(s): v for s, v in sorted(self.snapshots.items())}}
        atomic_write_text(self.path, json.dumps(body) + "\n")

    def load(self, resume_step: int | None) -> dict[str, Any] | None:
        """The snapshot of `resume_step` (else the latest one before it) with the events up to it, or None
        (one printed line) when there is no usable one. Keeps it for the next saves."""
        try:
            body = json.loads(self.path.read_text())
            snaps = {int(k): v for k, v in body["snapshots"].items()}
            events = [(int(a), str(b), str(c)) for a, b, c in body["events"]]
        except FileNotFoundError:
            print(f"areal_libra recover: no {CONTROL_STATE}; the controller starts fresh", flush=True)
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            print(f"areal_libra recover: control state unreadable ({type(e).__name__}); the controller starts "
                  "fresh", flush=True)
            return None
        usable = [s for s in snaps if resume_step is None or s <= resume_step]
        if not usable:
            print(f"areal_libra recover: no controller state at or before step {resume_step}; the controller "
                  "starts fresh", flush=True)
            return None
        step = max(usable)
        self.snapshots = {s: v for s, v in snaps.items() if s <= step}
        return {"step": step, **snaps[step], "events": [e for e in events if e[0] <= step]}


def save_control_state(run_dir: Path, step: int, cluster: Any) -> None:
    """The control loop's inputs worth keeping across a restart: the finished lengths history."""
    ControlStateFile(run_dir).save(step, cluster)


def restore_control_state(run_dir: Path, cluster: Any) -> int:
    """Reload the saved history into `cluster` (a LiveCluster); how many entries were restored."""
    p = Path(run_dir) / CONTROL_STATE
    try:
        body = json.loads(p.read_text())
        items = [(int(a), int(b)) for a, b in body["finished"]]
        # the planner's history by start version (absent in a state written before complete cohorts)
        cohorts = [(int(v), [(int(a), int(b)) for a, b in rows]) for v, rows in body.get("cohorts", ())]
    except FileNotFoundError:
        return 0
    except (OSError, ValueError, KeyError, TypeError):
        print("areal_libra recover: control history unreadable; the planner waits for new lengths", flush=True)
        return 0
    cluster.restore(items, cohorts or None)
    # stdout (trainer.log), like the control loop's own decisions
    print(f"areal_libra recover: restored {len(items)} finished lengths (control history of step "
          f"{body.get('step')})", flush=True)
    return len(items)
