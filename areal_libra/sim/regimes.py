"""Regime map: where Libra leads AReaL-Static-Optimal, swept one axis at a time around a base point.

Each point builds the synthetic agentic workload (areal_libra.sim.synthetic) and a cluster, runs
AReaL-Static-Optimal (the best static split and TP, chosen by simulating the first steps of every candidate
on the INITIAL workload) and Libra for the same number of steps, and reports libra / static and each
system's throughput as a fraction of its run's roofline bound (areal_libra.sim.roofline), with the figures
that explain the ratio: both layouts, busy fractions of training and rollout GPUs, reconfigurations and the
measured tool-time share. Lengths grow by `drift` over the run (the drift horizon is the run's length, so a
short run still sees the whole growth that the paper's 200 steps see).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from areal_libra.sim.hardware import truth_constants, truth_from_specs
from areal_libra.sim.registry import run_system
from areal_libra.sim.report import add_paper_unit, add_roofline
from areal_libra.sim.synthetic import SyntheticAgentic, SynthParams
from areal_libra.sim.systems import Env
from areal_libra.sim.workloads import WorkloadConfig

BASE_GPUS = 48
BASE_BATCH_PROMPTS = 16  # GRPO groups per step at 48 GPUs; scaled with the cluster size
GROUP_SIZE = 8
# The batch stops growing at 1,024 trajectories per step (128 prompts, reached at 384 GPUs): a proportional
# batch at 1,024 GPUs (2,730 trajectories) takes the static sweep alone beyond this machine's time budget.
MAX_BATCH_PROMPTS = 128


@dataclass(frozen=True)
class Point:
    tail: float = 4.0  # P99/median of generated tokens
    drift: float = 0.5  # relative length growth over the run (+50%: this simulator's paper-regime workloads)
    cap: int = 40960  # max model length (the paper's)
    tool_s: float = 2.0  # median tool latency per call
    eta: int = 4  # staleness bound (AReaL max_head_offpolicyness; 0 = synchronous)
    gpus: int = 48
    host: str = "sglang"  # serving engine host profile of the hardware truth (hardware.HOST_PROFILES)


# Axes of the map: values swept one at a time around the base point.
AXES: dict[str, tuple] = {
    "tail": (1.5, 4.0, 8.0, 16.0),
    "drift": (0.0, 0.5, 1.0, 2.0),
    "cap": (8192, 16384, 32768, 40960),
    "tool_s": (0.0, 2.0, 8.0, 30.0),
    "eta": (0, 1, 4, 8),
    "gpus": (48, 192, 1024),
    "host": ("sglang", "vllm-2023"),
}


def points(base: Point, axes: dict[str, tuple] = AXES) -> list[tuple[str, Point]]:
    """(axis, point) for every axis value; the base point is run once, under axis 'base'."""
    out = [("base", base)]
    for axis, values in axes.items():
        for v in values:
            p = replace(base, **{axis: v})
            if p != base:
                out.append((axis, p))
    return out


def make_point_env(p: Point, steps: int, model: str = "qwen3-14b", gpu: str = "a800", seed: int = 0,
                   truth: str = "default") -> Env:
    from areal_libra.cost.presets import load_cluster, load_model

    # The truth profile with the point's host profile; a non-default profile keeps its own host at the
    # base point's host (paper-level serves with vLLM), so only the host axis's other value overrides it.
    host = p.host if truth == "default" or p.host != Point.host else None
    consts = truth_constants(truth, host)
    cl = load_cluster(f"{gpu}x{p.gpus}")
    md = load_model(model)
    prompts = max(1, min(MAX_BATCH_PROMPTS, round(BASE_BATCH_PROMPTS * p.gpus / BASE_GPUS)))
    cfg = WorkloadConfig(group_size=GROUP_SIZE, batch_prompts=prompts, max_len=p.cap, horizon=steps, drift=p.drift)
    wl = SyntheticAgentic(cfg, SynthParams(tail=p.tail, tool_s=p.tool_s))
    return Env(truth_from_specs(cl.hardware, md, consts), wl, cl.n_gpus, cluster=cl, model=md, seed=seed, staleness=p.eta)


def _layout(sim) -> str:
    """The layout at the end of the run: training topology and the rollout server mix."""
    tps: dict[int, int] = {}
    for s in sim.servers:
        tps[s.tp] = tps.get(s.tp, 0) + 1
    mix = " + ".join(f"{n}xTP{tp}" for tp, n in sorted(tps.items()))
    lay = sim.train_layout
    return f"train {lay.gpus} (TP{lay.tp} PP{lay.pp} DP{lay.dp}), rollout {sum(s.tp for s in sim.servers)} ({mix})"


def tool_share(sim) -> float:
    """Share of a finished trajectory's wall time spent waiting on tools (last trajectories seen)."""
    trajs = list(sim.finished_trajs)
    durs = sim.traj_durations[-len(trajs):] if trajs else []
    wait = sum(s.tool.latency_s for t in trajs for s in t.segments if s.tool is not None)
    total = sum(durs)
    return wait / total if total > 0 else 0.0


def run_point(p: Point, steps: int, seed: int = 0, truth: str = "default") -> dict:
    env = make_point_env(p, steps, seed=seed, truth=truth)
    out: dict = {"point": p.__dict__.copy()}
    for name in ("areal_static_optimal", "libra"):
        t0 = time.time()
        res, sim = run_system(name, env, steps)
        add_roofline(res, sim)
        add_paper_unit(res, sim.records)
        out[name] = {
            "tokens_per_s": res["tokens_per_s"], "paper_tokens_per_s": res["paper_tokens_per_s"],
            "roofline_tokens_per_s": res["roofline_tokens_per_s"],
            "roofline_frac": res["roofline_frac"], "train_busy_frac": res["train_busy_frac"],
            "rollout_busy_frac": res["rollout_busy_frac"], "reconfigurations": res["reconfigurations"],
            "mean_step_s": res["mean_step_s"], "layout_end": _layout(sim), "sim_wall_s": round(time.time() - t0, 2),
        }
        first = sim.records[0]
        out[name]["split_start"] = f"train {first['train_gpus']} / rollout {first['rollout_gpus']}"
        if name == "libra":
            out["tool_time_share"] = tool_share(sim)
            out["mean_model_tokens"] = sum(t.model_tokens for t in sim.trained) / max(1, len(sim.trained))
    s, lb = out["areal_static_optimal"], out["libra"]
    out["libra_over_static"] = lb["tokens_per_s"] / s["tokens_per_s"] if s["tokens_per_s"] else 0.0
    out["libra_over_static_paper"] = (lb["paper_tokens_per_s"] / s["paper_tokens_per_s"]
                                      if s["paper_tokens_per_s"] else 0.0)
    out["libra_over_roofline"] = lb["roofline_frac"]
    out["static_over_roofline"] = s["roofline_frac"]
    return out


def steps_for(p: Point, steps: int, min_steps: int = 4) -> int:
    """Steps at a point: the batch grows with the cluster, so larger clusters run proportionally fewer steps
    (the same number of trajectories; the drift horizon follows, so the whole growth is still seen)."""
    prompts = min(MAX_BATCH_PROMPTS, BASE_BATCH_PROMPTS * p.gpus / BASE_GPUS)
    return max(min_steps, round(steps * BASE_BATCH_PROMPTS / max(BASE_BATCH_PROMPTS, prompts)))


def _run_indexed(args: tuple) -> tuple[int, dict]:
    i, axis, p, steps, seed, truth = args
    n = steps_for(p, steps)
    r = run_point(p, n, seed, truth)
    r.update(axis=axis, value=getattr(p, axis) if axis != "base" else None, steps=n)
    return i, r


def sweep(base: Point, steps: int, seed: int = 0, axes: dict[str, tuple] = AXES,
          log: Callable[[str], None] | None = None, jobs: int = 1, truth: str = "default") -> list[dict]:
    """Run every point (largest clusters first, so parallel workers finish together); results in point order.
    `truth` names the hardware truth profile (hardware.TRUTH_PROFILES)."""
    truth_constants(truth)  # an unknown profile fails here, before any worker starts
    todo = [(i, axis, p, steps, seed, truth) for i, (axis, p) in enumerate(points(base, axes))]
    todo.sort(key=lambda t: -t[2].gpus)
    results: dict[int, dict] = {}
    t0 = time.time()

    def done(r: dict) -> None:
        if log:
            log(f"[{len(results)}/{len(todo)}] {r['axis']}={r['value']} ({r['steps']} steps): libra/static "
                f"{r['libra_over_static']:.2f}, libra/roofline {r['libra_over_roofline']:.2f}, static/roofline "
                f"{r['static_over_roofline']:.2f} ({time.time() - t0:.0f} s elapsed)")

    if jobs <= 1:
        for t in todo:
            i, r = _run_indexed(t)
            results[i] = r
            done(r)
    else:
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(jobs) as ex:
            for fut in as_completed([ex.submit(_run_indexed, t) for t in todo]):
                i, r = fut.result()
                results[i] = r
                done(r)
    return [results[i] for i in sorted(results)]


def heatmap(path: str, results: list[dict], base: Point, axes: dict[str, tuple] = AXES) -> None:
    """Two panels (libra / static, libra / roofline): one row per axis, one cell per swept value."""
    import os
    import tempfile

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(axes)
    width = max(len(v) for v in axes.values())
    by = {(r["axis"], r["value"]): r for r in results}
    base_r = next(r for r in results if r["axis"] == "base")
    fig, panels = plt.subplots(1, 2, figsize=(14, 0.7 * len(names) + 1.6))
    for ax, key, title, cmap, lim in ((panels[0], "libra_over_static", "Libra / AReaL-Static-Optimal", "RdBu", (0.6, 1.4)),
                                      (panels[1], "libra_over_roofline", "Libra / roofline bound", "viridis", (0.0, 1.0))):
        grid = np.full((len(names), width), np.nan)
        for i, a in enumerate(names):
            for j, v in enumerate(axes[a]):
                r = base_r if v == getattr(base, a) else by.get((a, v))
                if r is None:
                    continue
                grid[i, j] = r[key]
                ax.text(j, i, f"{a}={v}\n{r[key]:.2f}", ha="center", va="center", fontsize=7)
        im = ax.imshow(grid, cmap=cmap, vmin=lim[0], vmax=lim[1], aspect="auto")
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names)
        ax.set_xticks([])
        ax.set_title(title)
        fig.colorbar(im, ax=ax, fraction=0.04)
    fig.suptitle(f"one axis at a time around the base point {base.__dict__}", fontsize=8)
    fig.tight_layout()
    fd, tmp = tempfile.mkstemp(suffix=".png", dir=os.path.dirname(os.path.abspath(path)))
    os.close(fd)
    fig.savefig(tmp, dpi=80)
    plt.close(fig)
    os.chmod(tmp, 0o644)  # mkstemp creates 0600
    os.replace(tmp, path)
