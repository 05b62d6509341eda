"""Soak benchmark: a long default run with a rollout server SIGKILLed at a fixed step interval.

    python -m evaluation.soak --steps 300 --kill-every 50 --out evaluation/figures/soak
    python -m evaluation.soak --steps 12 --kill-every 4 --out /tmp/soak-small     # a quick check

Runs `python -m areal_libra.launch experiment=dapo_math total_train_steps=STEPS` (the embedded CPU cluster,
libra mode, where the trainer replaces a dead server: areal_libra/rollout/revive.py), SIGKILLs one
serving rollout server (from the run's servers.json) every KILL_EVERY steps, and samples the resident
memory (RSS) of every process of the run (launcher, trainer, rollout servers, calculator tool workers,
helpers) every --sample-s seconds. At the end it writes <out>/soak.json and <out>/soak.png (reward per step
with the kills marked; RSS per process over time) and checks:

- nothing lost: AReaL's rollout counters (rollout/rejected_total: a workflow that raised, e.g. a request
  that found no server) stay 0, every step trained on a full batch (ppo_actor/n_seqs = batch_size x
  n_samples), and the accepted rollouts cover every consumed one (accepted >= steps x batch_size);
- every kill was followed by a replacement server (revive.jsonl);
- reward rises: the mean task reward of the last WINDOW steps exceeds that of the first WINDOW steps
  (WINDOW = max(3, steps // 6));
- memory flat: for each process alive for at least 10 samples, a least-squares line through its RSS after
  its warm-up (the first quarter of its samples) grows by at most max(5% of its median RSS, 32 MiB) over that
  span; every such process must be flat. Processes with fewer samples are listed as unjudged with their
  lifetimes. (A rollout server reaches its plateau within seconds: python -m evaluation.server_memory.)

Exit 0 if every check holds, 1 if one fails, 2 on bad input or a run that did not finish.
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

FLAT_REL = 0.05
FLAT_ABS_MIB = 32.0
MIN_JUDGED_SAMPLES = 10


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(d))
    return kids


def descendants(root: int) -> list[int]:
    kids, out, todo = _children(), [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def _is_server(cmdline: str) -> bool:
    """A rollout server's command line: the embedded server, or an emulated one (which starts it paced)."""
    return "embedded_server" in cmdline or "areal_libra.rollout.emulation" in cmdline


def role(cmd: list[str]) -> str:
    """What a process of the run is, from its command line."""
    text = " ".join(cmd)
    if "areal_libra.launch" in text:
        return "launcher"
    if "areal_libra.live.train" in text:
        return "trainer"
    if _is_server(text):
        port = cmd[cmd.index("--port") + 1] if "--port" in cmd and cmd.index("--port") + 1 < len(cmd) else "?"
        return f"server:{port}"
    if "_calc_worker" in text:
        return "tool-worker"
    return "other:" + (Path(cmd[0]).name if cmd and cmd[0] else "?")


def flat_check(samples: list[tuple[float, float]]) -> dict:
    """Least-squares RSS growth after the warm-up (the first quarter of the samples) against the threshold."""
    pts = samples[len(samples) // 4:]
    n = len(pts)
    ts = [t for t, _ in pts]
    ys = [y for _, y in pts]
    mt, my = sum(ts) / n, sum(ys) / n
    var = sum((t - mt) ** 2 for t in ts)
    slope = sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var if var > 0 else 0.0
    growth = slope * (ts[-1] - ts[0])
    median = sorted(ys)[n // 2]
    limit = max(FLAT_REL * median, FLAT_ABS_MIB)
    return {"samples": len(samples), "median_mib": round(median, 1), "growth_mib": round(growth, 1),
            "limit_mib": round(limit, 1), "flat": growth <= limit}


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def kill_a_server(run_dir: Path) -> dict | None:
    """SIGKILL one serving rollout server of the run (its process group); what was killed."""
    try:
        servers = json.loads((run_dir / "servers.json").read_text())["servers"]
    except (OSError, ValueError, KeyError):
        return None
    for s in servers:
        pid = s.get("pid")
        if s.get("state") != "serving" or not pid or not Path(f"/proc/{pid}").exists():
            continue
        if not _is_server(" ".join(_cmdline(int(pid)))):
            continue  # a recycled pid
        try:
            os.killpg(int(pid), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                continue
        return {"addr": s.get("addr"), "pid": int(pid)}
    return None


def stop_run(proc: subprocess.Popen) -> None:
    """Stop the launcher like Ctrl-C does (it then stops its trainer and servers); whatever of the run is
    still alive after that (the trainer and its servers run in their own sessions) is SIGKILLed."""
    if proc.poll() is None:
        tree = [(p, _cmdline(p)) for p in descendants(proc.pid)]
        os.kill(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        for pid, cmd in tree[1:]:
            if _cmdline(pid) != cmd or not cmd:  # gone, or the pid was reused
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _reward(rec: dict) -> float | None:
    for k in ("ppo_actor/task_reward/avg", "rollout/reward"):
        v = rec.get(k)
        if isinstance(v, (int, float)):
            return float(v)
    return None


def summarize(steps: int, kill_every: int, batch: int, n_samples: int, recs: list[dict], kills: list[dict],
              revives: list[dict], rss: dict[str, list[tuple[float, float]]], t0: float, rc: int) -> dict:
    rewards = [(int(r["step"]), _reward(r)) for r in recs if "step" in r]
    rewards = [(s, v) for s, v in rewards if v is not None]
    w = max(3, steps // 6)
    first = [v for _, v in rewards[:w]]
    last = [v for _, v in rewards[-w:]]
    last_rec = recs[-1] if recs else {}
    n_seqs = [r.get("ppo_actor/n_seqs") for r in recs]
    accepted = last_rec.get("rollout/accepted_total")
    rejected = last_rec.get("rollout/rejected_total")
    consumed = len(recs) * batch
    started = sum(len(r.get("started", [])) for r in revives)
    mem = {key: flat_check(s) for key, s in rss.items() if len(s) >= MIN_JUDGED_SAMPLES}
    unjudged = {key: round(s[-1][0] - s[0][0], 1) for key, s in rss.items() if len(s) < MIN_JUDGED_SAMPLES}
    checks = {
        "finished": rc == 0 and len(recs) == steps,
        "no_rollout_rejected": rejected == 0,
        "full_batches": all(n == batch * n_samples for n in n_seqs) and bool(n_seqs),
        "accepted_covers_consumed": isinstance(accepted, (int, float)) and accepted >= consumed,
        "every_kill_replaced": started >= len(kills) and len(kills) == len(range(kill_every, steps, kill_every)),
        "reward_rises": bool(first and last) and sum(last) / len(last) > sum(first) / len(first),
        "memory_flat": bool(mem) and all(m["flat"] for m in mem.values()),
    }
    return {
        "steps": steps, "kill_every": kill_every, "returncode": rc, "steps_done": len(recs),
        "batch_size": batch, "n_samples": n_samples, "wall_s": round(time.time() - t0, 1),
        "kills": kills, "revives": revives,
        "rollouts": {"accepted_total": accepted, "rejected_total": rejected, "consumed": consumed,
                     "failovers": sum(int(r.get("cmlfq/failovers", 0) or 0) for r in recs),
                     "health_down": sum(int(r.get("cmlfq/health_down", 0) or 0) for r in recs)},
        "reward": {"window": w, "first_mean": sum(first) / len(first) if first else None,
                   "last_mean": sum(last) / len(last) if last else None, "per_step": rewards},
        "memory": mem,
        "memory_unjudged_life_s": unjudged,
        "memory_criterion": f"least-squares RSS growth after the first quarter of samples <= max({FLAT_REL:.0%} "
                            f"of median, {FLAT_ABS_MIB:.0f} MiB), processes with >= {MIN_JUDGED_SAMPLES} samples",
        "checks": checks,
        "ok": all(checks.values()),
    }


def figure(summary: dict, rss: dict[str, list[tuple[float, float]]], t0: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 8))
    pts = summary["reward"]["per_step"]
    ax1.plot([s for s, _ in pts], [v for _, v in pts], lw=1, label="task reward")
    for i, k in enumerate(summary["kills"]):
        ax1.axvline(k["step"], color="red", ls="--", lw=0.8, label="server SIGKILL" if i == 0 else None)
    ax1.set_xlabel("training step")
    ax1.set_ylabel("reward")
    ax1.legend(loc="lower right")
    ok = "all checks hold" if summary["ok"] else "FAILED: " + ", ".join(k for k, v in summary["checks"].items() if not v)
    ax1.set_title(f"soak: {summary['steps_done']} steps, {len(summary['kills'])} server kills ({ok})")
    for key, s in sorted(rss.items()):
        if len(s) < 2:
            continue
        ax2.plot([(t - t0) / 60 for t, _ in s], [v for _, v in s], lw=1, label=key)
    for k in summary["kills"]:
        ax2.axvline((k["t"] - t0) / 60, color="red", ls="--", lw=0.8)
    ax2.set_xlabel("minutes")
    ax2.set_ylabel("RSS (MiB)")
    ax2.legend(fontsize=6, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--kill-every", type=int, default=50)
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--out", default="evaluation/figures/soak")
    ap.add_argument("--timeout-min", type=float, default=240.0)
    ap.add_argument("overrides", nargs="*", help="extra launch overrides (key=value)")
    a = ap.parse_args(argv)
    if a.steps < 2 or a.kill_every < 1 or a.kill_every >= a.steps or a.sample_s <= 0:
        print("soak: error: need --steps >= 2, 1 <= --kill-every < --steps and --sample-s > 0", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    root = (out / "run").resolve()
    batch, n_samples = 16, 8
    for ov in a.overrides:
        if "=" not in ov:
            print(f"soak: error: override {ov!r} is not key=value", file=sys.stderr)
            return 2
        k, v = ov.split("=", 1)
        if k == "train_dataset.batch_size":
            batch = int(v)
        elif k == "gconfig.n_samples":
            n_samples = int(v)
    cmd = [sys.executable, "-m", "areal_libra.launch", "experiment=dapo_math", f"total_train_steps={a.steps}",
           f"cluster.fileroot={root}", "trial_name=soak", *a.overrides]
    print("soak: $ " + " ".join(cmd), flush=True)
    t0 = time.time()
    log = open(out / "launch.log", "w")  # noqa: SIM115 - open for the run's lifetime
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    kills: list[dict] = []
    rss: dict[str, list[tuple[float, float]]] = {}
    run_dir: Path | None = None
    next_kill = a.kill_every
    next_sample = 0.0
    deadline = time.monotonic() + a.timeout_min * 60
    recs: list[dict] = []
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                print("soak: timeout; stopping the run", flush=True)
                break
            if run_dir is None:
                m = next(root.rglob("metrics.jsonl"), None) if root.exists() else None
                run_dir = m.parent if m is not None else None
            if run_dir is not None:
                recs = _read_jsonl(run_dir / "metrics.jsonl")
                if recs and int(recs[-1].get("step", 0)) >= next_kill and next_kill < a.steps:
                    k = kill_a_server(run_dir)
                    if k is not None:
                        k.update(step=int(recs[-1]["step"]), t=time.time())
                        kills.append(k)
                        print(f"soak: step {k['step']}: SIGKILL server {k['addr']} (pid {k['pid']})", flush=True)
                        next_kill += a.kill_every
            now = time.monotonic()
            if now >= next_sample:
                next_sample = now + a.sample_s
                t = time.time()
                for pid in descendants(proc.pid):
                    v = rss_mib(pid)
                    if v is not None:
                        rss.setdefault(f"{role(_cmdline(pid))}:{pid}", []).append((t, v))
                if recs:
                    r = recs[-1]
                    print(f"soak: step {r.get('step')}/{a.steps} reward {_reward(r)} "
                          f"rejected {r.get('rollout/rejected_total')} kills {len(kills)} "
                          f"elapsed {(t - t0) / 60:.1f} min", flush=True)
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("soak: interrupted; stopping the run", flush=True)
    finally:
        stop_run(proc)
        log.close()
    if run_dir is None:
        print(f"soak: error: the run wrote no metrics (rc {proc.returncode}); see {out / 'launch.log'}",
              file=sys.stderr)
        return 2
    recs = _read_jsonl(run_dir / "metrics.jsonl")
    revives = _read_jsonl(run_dir / "revive.jsonl")
    summary = summarize(a.steps, a.kill_every, batch, n_samples, recs, kills, revives, rss, t0, proc.returncode)
    summary["command"] = " ".join(cmd)
    summary["load_avg"] = os.getloadavg()
    tmp = out / "soak.json.tmp"
    tmp.write_text(json.dumps(summary | {"rss_series": {k: [(round(t - t0, 1), round(v, 1)) for t, v in s]
                                                         for k, s in rss.items()}}, indent=1) + "\n")
    os.replace(tmp, out / "soak.json")
    figure(summary, rss, t0, out / "soak.png")
    print(json.dumps({k: summary[k] for k in ("steps_done", "rollouts", "checks", "ok")}, indent=1))
    print(f"soak: wrote {out / 'soak.json'} and {out / 'soak.png'}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
