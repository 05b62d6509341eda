"""Recover benchmark: the trainer is SIGKILLed mid-run and the same command resumes it with AReaL's recover.

    python -m evaluation.recover --steps 12 --freq 2 --kill-after 7 --out /tmp/recover

Run A: `python -m areal_libra.launch experiment=dapo_math total_train_steps=STEPS recover.mode=auto
recover.freq_steps=FREQ`; once KILL_AFTER steps are logged the trainer process is SIGKILLed (the launcher
then stops with an error). Run B: the same command again. Checks:

- resumed: run B starts after the last recover checkpoint (AReaL's "Recovering from" in trainer.log), and
  metrics.jsonl holds steps 1..STEPS exactly once;
- state restored: the live prefix tree file and the control history were present and reloaded, and the
  controller resumed from its state at the checkpoint's step (control_state.json snapshots);
- with the elastic pool on (--set elastic.enabled=true ...) and a hybrid training at the checkpoint: it
  re-joins and trains again in run B (pool_rejoined);
- the reward curve continues: the mean task reward of run B's first 3 steps is above that of run A's
  first 3 steps (a restart from scratch would fall back to the start).

Writes <out>/recover.json and <out>/recover.png (reward per step, run A and run B, kill and checkpoint
marked). Exit 0 if every check holds, 1 if one fails, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from evaluation.soak import _read_jsonl, _reward, descendants, role, stop_run


def _trainer_pid(launcher: int) -> int | None:
    for pid in descendants(launcher):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if role(cmd) == "trainer":
            return pid
    return None


def run_once(cmd: list[str], log_path: Path, metrics: Path, kill_after: int | None, timeout_s: float) -> dict:
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        killed = None
        deadline = time.monotonic() + timeout_s
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                if kill_after is not None and killed is None and len(_read_jsonl(metrics)) >= kill_after:
                    pid = _trainer_pid(proc.pid)
                    if pid is not None:
                        os.kill(pid, signal.SIGKILL)
                        killed = {"pid": pid, "after_step": len(_read_jsonl(metrics)), "t": time.time()}
                        print(f"recover: SIGKILL trainer {pid} after step {killed['after_step']}", flush=True)
                time.sleep(0.3)
        finally:
            stop_run(proc)
    return {"rc": proc.returncode, "killed": killed, "wall_s": round(time.time() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--freq", type=int, default=2, help="recover.freq_steps")
    ap.add_argument("--kill-after", type=int, default=7)
    ap.add_argument("--out", default="/tmp/areal_libra_recover")
    ap.add_argument("--timeout-min", type=float, default=30.0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra launch override for both runs, e.g. libra.elastic.enabled=true (repeatable)")
    a = ap.parse_args(argv)
    if not (1 <= a.freq < a.kill_after < a.steps):
        print("recover: error: need 1 <= --freq < --kill-after < --steps", file=sys.stderr)
        return 2
    if any("=" not in x for x in a.set):
        print("recover: error: --set takes KEY=VALUE", file=sys.stderr)
        return 2
    out = Path(a.out)
    root = (out / "run").resolve()
    if root.exists():
        import shutil

        shutil.rmtree(root)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "areal_libra.launch", "experiment=dapo_math", f"total_train_steps={a.steps}",
           f"cluster.fileroot={root}", "trial_name=recover", "recover.mode=auto", f"recover.freq_steps={a.freq}", *a.set]
    run_dir = root / "logs" / os.environ.get("USER", "root") / "dapo-math" / "recover"
    metrics = run_dir / "metrics.jsonl"
    print("recover: $ " + " ".join(cmd), flush=True)
    ra = run_once(cmd, out / "run_a.log", metrics, a.kill_after, a.timeout_min * 60)
    recs_a = _read_jsonl(metrics)
    step_info = root / "checkpoints" / os.environ.get("USER", "root") / "dapo-math" / "recover" / "recover_info"
    try:
        ckpt_steps = int(json.loads((step_info / "step_info.json").read_text())["global_step"]) + 1
    except (OSError, ValueError, KeyError):
        ckpt_steps = None
    had_tree = (run_dir / "cmlfq_tree.bin").is_file()
    had_history = (run_dir / "control_state.json").is_file()
    trainer_log_a = (run_dir / "trainer.log").read_text(errors="replace") if (run_dir / "trainer.log").exists() else ""
    (out / "trainer_a.log").write_text(trainer_log_a)
    rb = run_once(cmd, out / "run_b.log", metrics, None, a.timeout_min * 60)
    recs_b = _read_jsonl(metrics)
    tlog = (run_dir / "trainer.log").read_text(errors="replace") if (run_dir / "trainer.log").exists() else ""
    rew_a = [(int(r["step"]), _reward(r)) for r in recs_a]
    rew_b = [(int(r["step"]), _reward(r)) for r in recs_b if ckpt_steps is not None and int(r["step"]) > ckpt_steps]
    nodes_a = [int(r.get("cmlfq/tree_nodes", 0)) for r in recs_a]
    nodes_b = [int(r.get("cmlfq/tree_nodes", 0)) for r in recs_b if ckpt_steps is not None and int(r["step"]) > ckpt_steps]
    first_a = [v for _, v in rew_a[:3] if v is not None]
    first_b = [v for _, v in rew_b[:3] if v is not None]
    checks = {
        "killed": ra["killed"] is not None and ra["rc"] != 0,
        "checkpoint": ckpt_steps is not None and ckpt_steps <= a.kill_after,
        "resumed_from_checkpoint": ckpt_steps is not None and "Recovering from" in tlog and rb["rc"] == 0,
        "steps_once_each": [int(r["step"]) for r in recs_b] == list(range(1, a.steps + 1)),
        # the live prefix tree run B starts with is run A's (a fresh one has ~tens of nodes after one step)
        "tree_restored": had_tree and bool(nodes_b) and nodes_b[0] >= max(nodes_a[:ckpt_steps or 0] or [1 << 30]),
        "history_restored": had_history and "areal_libra recover: restored" in tlog,
        # the controller continues from its state at the checkpoint's step instead of a fresh first plan
        "controller_restored": f"resumed: controller state of step {ckpt_steps}:" in tlog,
        "reward_continues": bool(first_a and first_b) and sum(first_b) / len(first_b) > sum(first_a) / len(first_a),
    }
    train_a = {int(r["step"]): r.get("elastic/n_training", 0) for r in recs_a}
    if ckpt_steps is not None and train_a.get(ckpt_steps):
        # a hybrid trained at the checkpoint: it re-joins (the join protocol) and trains again after the resume
        checks["pool_rejoined"] = "asked to re-join training" in tlog and any(
            r.get("elastic/n_training", 0) >= 1 for r in recs_b if int(r["step"]) > ckpt_steps)
    summary = {"command": " ".join(cmd), "steps": a.steps, "freq": a.freq, "kill_after": a.kill_after,
               "run_a": ra, "run_b": rb, "checkpoint_steps": ckpt_steps, "tree_nodes_a": nodes_a, "tree_nodes_b": nodes_b, "reward_a": rew_a, "reward_b": rew_b,
               "first3_a": sum(first_a) / len(first_a) if first_a else None,
               "first3_b_after_resume": sum(first_b) / len(first_b) if first_b else None,
               "control_after_resume": [ln.strip() for ln in tlog.splitlines()
                                        if "areal_libra control:" in ln or "areal_libra recover:" in ln],
               "checks": checks, "ok": all(checks.values()), "load_avg": os.getloadavg()}
    tmp = out / "recover.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1) + "\n")
    os.replace(tmp, out / "recover.json")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot([s for s, _ in rew_a], [v for _, v in rew_a], "o-", label="run A (trainer SIGKILLed)")
    ax.plot([s for s, _ in rew_b], [v for _, v in rew_b], "s-", label="run B (same command, recovered)")
    if ra["killed"]:
        ax.axvline(ra["killed"]["after_step"], color="red", ls="--", lw=0.8, label="SIGKILL")
    if ckpt_steps:
        ax.axvline(ckpt_steps, color="green", ls=":", lw=0.8, label="last recover checkpoint")
    ax.set_xlabel("training step")
    ax.set_ylabel("task reward")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "recover.png", dpi=110)
    print(json.dumps({k: summary[k] for k in ("checkpoint_steps", "first3_a", "first3_b_after_resume", "checks",
                                              "ok")}, indent=1))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
