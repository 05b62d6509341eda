"""Replay one fixed observation sequence through a live run's decision path and print its control events.

    python -m evaluation.replay_live_decisions --run live_ab|live_ab_growing|live_elastic

The decision path is the live one (LiveControl + LiveCluster + the LibraController with the real planner on
the emulated cluster, configured exactly as evaluation.live_ab's libra run or evaluation.live_elastic's run);
only the measurements are a fixed script instead of a trainer, so two trees can be compared decision by
decision without this machine's timing noise (issue 22: decisions unchanged by the refactor). The script
also runs on trees from before the refactor (areal_libra.integration), for that comparison.
"""

from __future__ import annotations

import argparse
import importlib
import json

from areal_libra.config import compose, libra_config
from areal_libra.control import PoolView, StepObservation

try:
    from areal_libra.live.live_cluster import LiveCluster, LiveControl, plan_source
    from areal_libra.rollout.emulation import ClusterEmulation
    from areal_libra.rollout.groups import resolve_groups
except ImportError:  # a tree from before issue 22 step 1
    from areal_libra.integration.emulation import ClusterEmulation
    from areal_libra.integration.groups import resolve_groups
    from areal_libra.integration.live_cluster import LiveCluster, LiveControl, plan_source

AB = ["experiment=dapo_math", "cluster=emulated", "libra.mode=libra", "total_train_steps=40",
      "libra.emulated.time_scale=2.0", "cluster.fileroot=/tmp/replay-live-decisions"]
RUNS = {
    # evaluation.live_ab's libra run with the README's settings (lengths 1x -> 2x over 40 steps), no pool
    "live_ab": AB + ["libra.emulated.length_growth=1.0", "libra.emulated.growth_horizon=40"],
    # the same run with lengths growing 40x over 20 steps, so the planner's new plans move
    "live_ab_growing": AB + ["libra.emulated.length_growth=39.0", "libra.emulated.growth_horizon=20"],
    # evaluation.live_elastic's run: 8 emulated H100s, one hybrid
    "live_elastic": ["experiment=dapo_math", "cluster=emulated", "libra.elastic.enabled=true",
                     "libra.emulated.accelerators=8", "libra.emulated.gpu=h100", "libra.emulated.length_growth=39.0",
                     "libra.emulated.growth_horizon=20", "libra.emulated.time_scale=2.0",
                     "libra.control.elastic_persist=3", "train_dataset.batch_size=4", "total_train_steps=30",
                     "cluster.fileroot=/tmp/replay-live-decisions"],
}


class ScriptedPool:
    """One hybrid replica: a join takes 3 steps, a release 1; the step's observation is set by the script."""

    def __init__(self) -> None:
        self.training, self.idle, self.busy_until, self.pending, self.step = 0, 1, -1, None, 0
        self.obs = None
        self.inputs: dict = {}

    def tick(self, step: int) -> None:
        self.step = step
        if self.pending and step >= self.busy_until:
            kind, self.pending = self.pending, None
            self.training, self.idle = (1, 0) if kind == "join" else (0, 1)

    def pool_view(self) -> PoolView:
        return PoolView(training=self.training, idle=self.idle, train_replicas=1 + self.training,
                        rollout_gpus=7 - self.training, unit_gpus=1, busy=self.pending is not None)

    def observation(self):
        return self.obs

    def rollout_inputs(self) -> dict:
        return self.inputs

    def join(self, n: int) -> int:
        self.pending, self.busy_until = "join", self.step + 3
        return 1

    def release(self, n: int) -> int:
        self.pending, self.busy_until = "release", self.step + 1
        return 1


def _trajectory(i: int):
    prompt = 60 + i % 7
    return type("T", (), {"prompt_tokens": prompt, "final_length": prompt + 20 + (i * 13) % 90})()


def replay(run: str) -> list[dict]:
    c = compose(RUNS[run])
    typed = libra_config(c.libra)
    lc = importlib.import_module(LiveCluster.__module__)  # before step 5 the trainer built ControlConfig itself
    cfg = lc.control_config(typed) if hasattr(lc, "control_config") else typed.control
    if hasattr(lc, "run_control_config"):  # the run's eta, as the trainer's install_control sets it
        cfg = lc.run_control_config(cfg, c.areal)
    old_tree = "integration" in LiveCluster.__module__
    source = plan_source(c.libra if old_tree else typed, c.areal, "unused")
    emu = ClusterEmulation.from_libra(c.libra)
    events: list[dict] = []
    elastic = run == "live_elastic"
    pool = ScriptedPool() if elastic else None
    if elastic:
        groups = resolve_groups(c.libra, int(c.areal.gconfig.max_tokens))
        cluster = LiveCluster(None, pool, history_len=cfg.history, max_tokens=int(c.areal.gconfig.max_tokens),
                              groups=groups, emulation=emu)
        control = LiveControl(cfg, source, cluster, profile_steps=typed.control.profile_steps,
                              pressure_fn=lambda: (0.0, 0.1))
    else:
        cluster = LiveCluster(None, None, history_len=cfg.history, max_running=256,
                              max_tokens=int(c.areal.gconfig.max_tokens), groups=[])
        cluster.emulation = emu  # as the trainer's install_emulation does
        control = LiveControl(cfg, source, cluster, profile_steps=typed.control.profile_steps,
                              pressure_fn=lambda: (0.0, 0.3))
    control._record = events.append
    steps = int(c.areal.total_train_steps)
    for step in range(1, steps + 1):
        cluster.version = step
        mult = emu.multiplier(step)
        if elastic:
            pool.tick(step)
            for i in range(32):
                cluster.on_trajectory(_trajectory(i))
            train = 4.0 / (1 + pool.training) + 1.0  # the trainer: faster with the hybrid
            roll = 0.25 * mult / (1 - 0.14 * pool.training)  # rollout: slower without the hybrid
            wait = max(0.0, roll - train)
            pool.obs = StepObservation(step=step, interval_s=train + wait, train_s=train, rollout_s=roll,
                                       queue_pressure=0.0, active_pressure=0.1)
            pool.inputs = {"wait_s": wait, "backlog": 0, "batch": 4, "idle_s": max(0.0, train + wait - roll),
                           "interval_s": train + wait}
        else:
            for i in range(128):  # 16 prompts x 8 samples, (prompt, final) before the emulated growth
                cluster.on_trajectory(_trajectory(i))
            train = 2.0
            scale = 0.3 if run == "live_ab_growing" else 1.2
            roll = scale * mult * (1 + 0.1 * ((step * 7) % 5))  # grows with the lengths, some noise
            wait = max(0.0, roll - train)
        control.on_step(step, {"step_time_s": train + wait, "timeperf/train_step": train,
                               "timeperf/rollout": wait})
    return [{"step": e["step"], "event": e["event"], "detail": e["detail"].split("(solved")[0]} for e in events]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evaluation.replay_live_decisions", description=__doc__.splitlines()[0])
    ap.add_argument("--run", choices=sorted(RUNS), required=True)
    args = ap.parse_args(argv)
    print(json.dumps({"run": args.run, "events": replay(args.run)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
