"""Workloads for the simulator: trace generators and trace replays, with drift over training steps.

A workload hands out GRPO groups (`group_size` trajectories of one prompt) for a given policy version;
drift makes the distribution depend on that version, as a policy's behaviour changes while it trains.
Every workload yields canonical `Trajectory` objects (areal_libra/trace.py), so any canonical trace file
can be a workload too.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import math
import random
from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass, fields
from pathlib import Path

from areal_libra.trace import Segment, ToolReturn, TraceError, Trajectory, read_traces

log = logging.getLogger(__name__)

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "polytrace"
if not DATA.is_dir():  # repository checked out elsewhere: look next to the working tree too
    DATA = Path("/work/shared/data/polytrace")

WORKLOADS = ("search_r1", "dapo_math", "r2e_gym")


def lognormal(rand, mu: float, sigma: float) -> float:
    """random.Random.lognormvariate(mu, sigma) drawn from `rand` (that generator's random()): the same
    draws and arithmetic as CPython's (Kinderman-Monahan normal, then exp), without two method calls per
    draw; tests/sim/test_sim_speed.py checks it matches the standard library draw for draw."""
    log = math.log
    while True:
        u1 = rand()
        u2 = 1.0 - rand()
        z = _NV_MAGICCONST * (u1 - 0.5) / u2
        zz = z * z / 4.0
        if zz <= -log(u2):
            break
    return math.exp(mu + z * sigma)


_NV_MAGICCONST = random.NV_MAGICCONST

_new_object = object.__new__


def _frozen_maker(cls, names: tuple[str, ...]):
    """A fast constructor for the frozen dataclass `cls` with exactly the fields `names` (positional): the
    object's __dict__ filled in one call instead of one object.__setattr__ per field (the workloads build
    a Segment and a ToolReturn per turn, a hot path of paper-scale runs). The same object either way; the
    plain class when its fields differ."""
    if tuple(f.name for f in fields(cls)) != names or hasattr(cls, "__post_init__") or "__slots__" in vars(cls):
        return cls
    if len(names) == 2:
        a, b = names

        def make2(x, y):
            o = _new_object(cls)
            d = o.__dict__
            d[a] = x
            d[b] = y
            return o

        return make2
    a, b, c, e = names

    def make4(w, x, y, z):
        o = _new_object(cls)
        d = o.__dict__
        d[a] = w
        d[b] = x
        d[c] = y
        d[e] = z
        return o

    return make4


_segment = _frozen_maker(Segment, ("gen_tokens", "tool"))
_tool = _frozen_maker(ToolReturn, ("name", "payload_tokens", "status", "latency_s"))


@dataclass
class WorkloadConfig:
    group_size: int = 16
    batch_prompts: int = 16  # prompts (GRPO groups) per training step
    max_len: int = 40960
    horizon: int = 200  # steps over which drift reaches its full amount
    drift: float = 0.5  # relative growth of lengths (or turns) at the horizon
    length_scale: float = 1.0  # multiplies model tokens (thinking-model regime for short traces)


class Workload:
    name = "workload"

    def __init__(self, cfg: WorkloadConfig):
        self.cfg = cfg
        self._n = 0

    def progress(self, version: int) -> float:
        return min(1.0, max(0, version) / max(1, self.cfg.horizon))

    def sample_group(self, version: int, rng: random.Random) -> list[Trajectory]:
        raise NotImplementedError

    def profile(self, n_groups: int, seed: int = 12345) -> list[Trajectory]:
        """What a user knows before training: trajectories of the initial policy (a profiling run)."""
        rng = random.Random(seed)
        out: list[Trajectory] = []
        for _ in range(n_groups):
            out.extend(self.sample_group(0, rng))
        return out

    def _tid(self, version: int, prompt_id: str) -> str:
        self._n += 1
        return f"v{version}-{prompt_id}-{self._n}"

    def _cap(self, prompt: int, segments: list[Segment]) -> tuple[tuple[Segment, ...], str]:
        """Truncate at the max model length: generation stops, finish_reason 'length'."""
        budget = self.cfg.max_len - prompt
        out = []
        for s in segments:
            if s.gen_tokens >= budget:
                out.append(Segment(max(1, budget), None))
                return tuple(out), "length"
            budget -= s.gen_tokens
            pay = s.tool.payload_tokens if s.tool else 0
            if s.tool is not None and pay >= budget:
                out.append(Segment(s.gen_tokens, None))
                return tuple(out), "length"
            budget -= pay
            out.append(s)
        last = out[-1]
        if last.tool is not None:
            out[-1] = Segment(last.gen_tokens, None)
        return tuple(out), "stop"


def _where(paths) -> str:
    if isinstance(paths, (str, Path)):
        return str(paths)
    files = [Path(p) for p in paths]
    return str(files[0].parent) if files else "trace"


def _drop_stub_step(steps: list[int], counts: dict[int, int], paths) -> list[int]:
    """Leave out a last step that holds under a tenth of the median step's trajectories (a partial recording,
    as PolyTrace Search-R1's step 5: 47 of 2,048): replayed for every version after the trace's end it would
    repeat a few prompts for the rest of the run. Said on stderr (logging), never silently."""
    if len(steps) < 3:
        return steps
    full = sorted(counts[s] for s in steps[:-1])
    median = full[len(full) // 2]
    last = steps[-1]
    if counts[last] * 10 >= median:
        return steps
    log.warning("%s: trace step %d holds %d trajectories (the median step %d): left out of the replay, which "
                "repeats step %d after the trace's end", _where(paths), last, counts[last], median, steps[-2])
    return steps[:-1]


class TraceWorkload(Workload):
    """Replay of a canonical (or PolyTrace) trace: groups by prompt id; the trace's own steps give drift
    (policy version v replays the groups of the v-th distinct step, the last one after that), and
    `drift`/`length_scale` stretch model tokens further."""

    name = "trace"

    def __init__(self, paths, cfg: WorkloadConfig, growth_on_gen: bool = True):
        super().__init__(cfg)
        trajs = read_traces(paths)
        if not trajs:
            raise TraceError(f"{paths}: trace holds no trajectories")
        by_step: dict[int, dict[str, list[Trajectory]]] = defaultdict(lambda: defaultdict(list))
        for t in trajs:
            by_step[t.step][t.prompt_id].append(t)
        self.steps = sorted(by_step)
        self.steps = _drop_stub_step(self.steps, {s: sum(map(len, by_step[s].values())) for s in self.steps}, paths)
        self.groups = {s: list(by_step[s].values()) for s in self.steps}
        self.growth_on_gen = growth_on_gen
        if not cfg.group_size:  # replay the trace's own groups at its median group size (the planner needs one)
            sizes = sorted(len(g) for gs in self.groups.values() for g in gs)
            cfg.group_size = sizes[len(sizes) // 2]

    def __deepcopy__(self, memo: dict) -> TraceWorkload:
        """A copy with its own config and counters that shares the trace's trajectories: they are only read
        (sample_group builds new ones), and copying 10,240 of them cost seconds per sweep candidate."""
        new = copy.copy(self)
        memo[id(self)] = new
        new.cfg = copy.deepcopy(self.cfg, memo)
        return new

    def sample_group(self, version: int, rng: random.Random) -> list[Trajectory]:
        step = self.steps[min(max(version, 0), len(self.steps) - 1)]
        src = rng.choice(self.groups[step])
        scale = self.cfg.length_scale * (1.0 + self.cfg.drift * self.progress(version))
        n = self.cfg.group_size or len(src)
        picks = src if n == len(src) else [src[i % len(src)] for i in range(n)]
        out = []
        for t in picks:
            segs = [_segment(max(1, round(s.gen_tokens * scale)), s.tool) for s in t.segments]
            segs_c, fr = self._cap(t.prompt_tokens, segs)
            if t.finish_reason == "length" and fr == "stop":
                fr = "length"
            out.append(Trajectory(self._tid(version, t.prompt_id), t.prompt_id, version, t.prompt_tokens,
                                  segs_c, fr, t.reward))
        return out


class DapoMath(Workload):
    """Long single- or two-turn math reasoning from the PolyTrace math mixture (4-component Gaussian mixture
    over (input, output) tokens), capped at `response_cap` (cap hits end with 'length'); lengths grow over
    training. A prompt draws a difficulty shared by its group, so a prompt's samples resemble each other."""

    name = "dapo_math"

    def __init__(self, cfg: WorkloadConfig, response_cap: int = 20480, p_tool: float = 0.3):
        super().__init__(cfg)
        path = DATA / "distributions" / "enhanced_task_distribution_parameters.json"
        try:
            g = json.loads(path.read_text())["math_task"]["gmm_parameters"]
        except (OSError, KeyError, json.JSONDecodeError) as e:
            raise TraceError(f"{path}: cannot read the math mixture ({e})") from None
        self.w = g["weights"]
        self.means = g["means"]
        self.sd = [(math.sqrt(c[0][0]), math.sqrt(c[1][1])) for c in g["covariances"]]
        self.cap_tokens = response_cap
        self.p_tool = p_tool
        self._prompts = 0

    def sample_group(self, version: int, rng: random.Random) -> list[Trajectory]:
        self._prompts += 1
        pid = f"math-{rng.randrange(17000)}"
        prng = random.Random(pid)  # a prompt keeps its length and difficulty when it is drawn again
        comp = prng.choices(range(len(self.w)), weights=self.w)[0]
        (mi, mo), (si, so) = self.means[comp], self.sd[comp]
        prompt = max(16, int(prng.gauss(mi, si)))
        z = prng.gauss(0.0, 1.0)
        grow = 1.0 + self.cfg.drift * self.progress(version)
        uses_tool = prng.random() < self.p_tool
        out = []
        for _ in range(self.cfg.group_size):
            gen = (mo + so * (0.7 * z + 0.71 * rng.gauss(0.0, 1.0))) * grow * self.cfg.length_scale
            gen = max(64, int(gen))
            fr = "stop"
            if gen >= self.cap_tokens:
                gen, fr = self.cap_tokens, "length"
            if uses_tool and gen > 400 and fr == "stop":
                cut = int(gen * rng.uniform(0.3, 0.7))
                tool = ToolReturn("python", int(rng.lognormvariate(math.log(120), 0.6)),
                                  "success" if rng.random() > 0.1 else "failure", rng.lognormvariate(math.log(0.6), 0.5))
                segs = [Segment(cut, tool), Segment(gen - cut, None)]
            else:
                segs = [Segment(gen, None)]
            segs_c, fr2 = self._cap(prompt, segs)
            out.append(Trajectory(self._tid(version, pid), pid, version, prompt, segs_c,
                                  "length" if "length" in (fr, fr2) else "stop"))
        return out


class R2EGym(Workload):
    """Software-engineering agent: many turns of bash / python / file-view tools with large file-view
    payloads, failures that trigger a retry turn, and a heavy tail from per-prompt difficulty (a few hard
    issues take dozens of turns). Drift: more turns and fewer failures as the policy trains."""

    name = "r2e_gym"
    TOOLS = (  # name, weight, payload median tokens, payload sigma, latency median s
        ("bash", 0.50, 220, 0.9, 1.2),
        ("python", 0.25, 180, 0.8, 3.0),
        ("file_view", 0.25, 1500, 0.7, 0.3),
    )

    _NAMES = [t[0] for t in TOOLS]
    _CUM = list(itertools.accumulate(t[1] for t in TOOLS))
    _SPEC = {t[0]: t for t in TOOLS}

    def __init__(self, cfg: WorkloadConfig, max_turns: int = 80):
        super().__init__(cfg)
        self.max_turns = max_turns

    def sample_group(self, version: int, rng: random.Random) -> list[Trajectory]:
        pid = f"r2e-{rng.randrange(4578)}"
        prng = random.Random(pid)  # an issue keeps its prompt and difficulty when it is drawn again
        prompt = int(prng.lognormvariate(math.log(1800), 0.3))
        hard = prng.random() < 0.12  # hard issues: long explorations with long test runs
        difficulty = prng.lognormvariate(0.0, 0.7) * (12.0 if hard else 1.0)
        slow = 2.5 if hard else 1.0
        p = self.progress(version)
        turns_mean = 3.5 * difficulty * (1.0 + self.cfg.drift * p)
        p_fail = 0.15 - 0.07 * p
        # The hot path of paper-scale runs: the same draws in the same order as the plain loop, with the
        # constants hoisted. choices(names, cum_weights=cum)[0] is names[bisect(cum, random() * total)]
        # (its documented algorithm), and lognormal() is rng.lognormvariate without the method calls.
        names, cum, spec = self._NAMES, self._CUM, self._SPEC
        uniform = rng.random
        total, hi = cum[-1] + 0.0, len(cum) - 1
        ls = self.cfg.length_scale
        max_turns = self.max_turns
        log180, log250 = math.log(180), math.log(250)
        out = []
        for _ in range(self.cfg.group_size):
            n_turns = min(max_turns, 1 + int(rng.expovariate(1.0 / max(0.5, turns_mean - 1))))
            segs = []
            for k in range(n_turns):
                gen = max(8, int(lognormal(uniform, log180, 0.7) * ls * slow))
                if k == n_turns - 1:
                    segs.append(_segment(gen, None))
                    break
                name = names[bisect_right(cum, uniform() * total, 0, hi)]
                _, _, med, sig, lat = spec[name]
                u = uniform()
                if u < 0.02:
                    status, payload, latency = "timeout", 40, 30.0
                elif u < 0.02 + p_fail:
                    status, payload, latency = "failure", int(lognormal(uniform, log250, 0.6)), lat * 0.5
                else:
                    status = "success"
                    payload = int(lognormal(uniform, math.log(med), sig))
                    latency = lognormal(uniform, math.log(lat * slow), 0.6)
                segs.append(_segment(gen, _tool(name, payload, status, latency)))
                if status != "success" and len(segs) < max_turns - 1:
                    # A failed call is retried: one more short turn that repeats the call.
                    retry = _tool(name, int(lognormal(uniform, math.log(med), sig)), "success",
                                       lognormal(uniform, math.log(lat), 0.6))
                    segs.append(_segment(max(8, int(gen * 0.4)), retry))
            segs_c, fr = self._cap(prompt, segs)
            out.append(Trajectory(self._tid(version, pid), pid, version, prompt, segs_c, fr))
        return out


def make_workload(name: str, cfg: WorkloadConfig | None = None) -> Workload:
    """`search_r1`, `dapo_math`, `r2e_gym`, or a path to a canonical / PolyTrace trace file or folder."""
    if name == "search_r1":
        c = cfg or WorkloadConfig(group_size=8, batch_prompts=32, length_scale=6.0, drift=0.5)
        files = sorted((DATA / "search_r1").glob("step_[0-4].jsonl.gz"))
        if not files:
            raise TraceError(f"{DATA / 'search_r1'}: PolyTrace Search-R1 traces not found")
        w = TraceWorkload(files, c)
        w.name = "search_r1"
        return w
    if name == "dapo_math":
        return DapoMath(cfg or WorkloadConfig(group_size=16, batch_prompts=16, drift=0.4))
    if name == "r2e_gym":
        return R2EGym(cfg or WorkloadConfig(group_size=8, batch_prompts=16, drift=0.5))
    p = Path(name)
    if p.is_dir():
        files = sorted(list(p.glob("*.jsonl")) + list(p.glob("*.jsonl.gz")))
        if not files:
            raise TraceError(f"{p}: folder holds no .jsonl or .jsonl.gz trace")
        return TraceWorkload(files, cfg or WorkloadConfig(group_size=0, drift=0.0))
    if p.suffix in (".jsonl", ".gz") or p.exists():
        if not p.is_file():
            raise TraceError(f"{p}: no such trace file")
        w = TraceWorkload([p], cfg or WorkloadConfig(group_size=0, drift=0.0))
        w.name = p.name
        return w
    raise ValueError(f"unknown workload {name!r}: use one of {', '.join(WORKLOADS)} or a trace file path")
