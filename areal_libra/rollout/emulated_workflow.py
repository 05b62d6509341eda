"""EmulatedWorkflow: the workload's trajectories, played through AReaL's rollout loop against emulated
servers (areal_libra.rollout.emulated_host), with no model computing them.

Each prompt's GRPO group is drawn from the same workload generator the simulator replays
(areal_libra.sim.workloads: search_r1, dapo_math, r2e_gym or a trace file) at the weight version the
episode starts at, so lengths grow with the version as there. Each trajectory is played turn by turn through
`engine.agenerate` (the router and C-MLFQ see every turn, with the emulated context, model tokens and tool
returns in the metadata): a turn asks for its segment's generated tokens (`max_new_tokens`), the request id
carries the emulated context (emulated_host.emulated_rid); a tool call then waits the workload's latency
(times the time scale) and adds its payload to the context. The tensors hold a few real token ids per turn;
`emul_tokens` carries the trajectory's emulated length for the paced trainer, and the trajectory sink gets
the emulated Trajectory (the planner's history, the metrics' tokens).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import os
import random
from collections import defaultdict, deque
from typing import Any

import torch
from areal.api import InferenceEngine, ModelRequest, RolloutWorkflow
from areal.api.cli_args import GenerationHyperparameters
from areal.infra import workflow_context
from areal.utils import stats_tracker

from areal_libra.rollout.emulated_host import TOKEN_ID, emulated_rid
from areal_libra.sim.workloads import make_workload
from areal_libra.trace import Segment, Trajectory
from areal_libra.workflows.sink import emit, running, set_trajectory_sink  # noqa: F401 - re-exported for the sink lookup
from areal_libra.workflows.tensors import Episode

_SHARED: dict[tuple, tuple] = {}  # (workload, seed, group size, max_len) -> (generator, RNG, group queues)
PROMPT_IDS = [TOKEN_ID] * 2  # the real prompt: two ids; its emulated length is the workload's
# Unique ids from a counter (uuid4 reads os.urandom: 2.6 CPU-s of the rollout thread at 64 x H200, one per turn).
_IDS = itertools.count()
_ID_PREFIX = f"{os.getpid():x}{random.getrandbits(24):06x}"


def _uid() -> str:
    return f"{_ID_PREFIX}{next(_IDS):x}"


def emulated_dataset(path: Any = None, size: int = 4096, seed: int = 0, max_rows: int | None = None) -> Any:
    """Rows that only name a prompt slot (the workload draws the prompt itself)."""
    from datasets import Dataset

    n = int(max_rows or size)
    return Dataset.from_list([{"prompt_index": i, "messages": [{"role": "user", "content": str(i)}]}
                              for i in range(n)])


class EmulatedWorkflow(RolloutWorkflow):
    def __init__(self, gconfig: GenerationHyperparameters, workload: str = "search_r1", seed: int = 0,
                 time_scale: float = 1.0, group_size: int | None = None, max_len: int | None = None,
                 tokenizer_path: str | None = None, max_turns: int | None = None, profile_groups: int = 0,
                 **_: Any) -> None:
        """`profile_groups` > 0: the profiling pass's workflow (live.train.profile_pass): prompt i plays group i of
        the workload's profile (Workload.profile, the groups the simulator's first plan is solved on)."""
        self.gconfig = gconfig.new(n_samples=1)
        # AReaL builds the workflow anew at every prepare_batch: one generator, RNG and group queue per setting
        # and process, so the draws continue across steps (a fresh Random(seed) each step repeated them) and
        # the workload's trace is read once.
        key = (str(workload), int(seed), int(group_size or gconfig.n_samples), int(max_len or 0), int(profile_groups))
        if key not in _SHARED:
            wl = make_workload(workload)
            wl.cfg.group_size = key[2]
            if max_len:
                wl.cfg.max_len = int(max_len)
            groups: defaultdict = defaultdict(deque)
            if profile_groups > 0:  # the profile's groups, drawn as the simulator draws them, by prompt index
                flat = wl.profile(int(profile_groups))
                for i in range(int(profile_groups)):
                    groups[i].extend(flat[i * key[2]:(i + 1) * key[2]])
            _SHARED[key] = (wl, random.Random(seed), groups)
        self.workload, self.rng, self._groups = _SHARED[key]
        self.profile = int(profile_groups)
        self.time_scale = float(time_scale)

    def _gconfig(self, tokens: int) -> GenerationHyperparameters:
        """The turn's sampling settings: a shallow copy (AReaL's agenerate sets max_new_tokens on it), not
        GenerationHyperparameters.new (asdict + a new instance: 2.1 CPU-s of the rollout thread at 64 x H200)."""
        g = copy.copy(self.gconfig)
        g.max_new_tokens = max(1, int(tokens))
        return g

    @classmethod
    def profile_kwargs(cls, groups: int) -> dict[str, Any]:
        return {"profile_groups": int(groups)}

    @classmethod
    def libra_kwargs(cls, libra: Any) -> dict[str, Any]:
        em = libra.emulated
        return {"workload": str(em.workload), "seed": int(em.seed), "time_scale": float(em.time_scale)}

    def _next(self, key: Any, version: int) -> Trajectory:
        if self.profile:
            key = int(key) % self.profile
        q = self._groups[key]
        if not q:  # the group's first sample: draw the whole group (a prompt's samples resemble each other)
            q.extend(self.workload.sample_group(version, self.rng))
        return q.popleft()

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> dict[str, torch.Tensor]:
        version = engine.get_version()
        with running(version):  # in flight at its start version (the controller's complete cohorts)
            return await self._episode(engine, data, version)

    async def _episode(self, engine: InferenceEngine, data: dict[str, Any], version: int) -> dict[str, torch.Tensor]:
        script = self._next(data.get("prompt_index", id(data)), version)
        traj_id = f"{script.prompt_id}-{_uid()}"
        ep = Episode()
        ep.add_context(PROMPT_IDS)
        ctx = script.prompt_tokens
        model_tokens = 0
        tool_meta: list[dict[str, Any]] = []
        segments: list[Segment] = []
        for k, seg in enumerate(script.segments):
            last = k == len(script.segments) - 1
            req = ModelRequest(
                rid=emulated_rid(_uid(), traj_id, ctx, last),
                input_ids=list(ep.seq),
                gconfig=self._gconfig(seg.gen_tokens),
                metadata={"trajectory_id": traj_id, "prompt_id": script.prompt_id, "turn": k,
                          "prompt_tokens": script.prompt_tokens, "context_tokens": ctx,
                          "model_tokens": model_tokens, "tool_returns": [dict(t) for t in tool_meta]},
            )
            ep.add_output(await engine.agenerate(req))
            ctx += seg.gen_tokens
            model_tokens += seg.gen_tokens
            segments.append(seg)
            if seg.tool is None:
                break
            await asyncio.sleep(seg.tool.latency_s * self.time_scale)  # the tool runs in emulated time
            ctx += seg.tool.payload_tokens
            ep.add_context([TOKEN_ID])
            tool_meta.append({"name": seg.tool.name, "payload_tokens": seg.tool.payload_tokens,
                              "status": seg.tool.status})
        reward = script.reward if script.reward is not None else float(self.rng.random() < 0.5)
        stats_tracker.get(workflow_context.stat_scope()).scalar(
            reward=reward, num_turns=len(segments), tool_calls=len(tool_meta), gen_tokens=model_tokens)
        traj = Trajectory(trajectory_id=traj_id, prompt_id=script.prompt_id, step=version,
                          prompt_tokens=script.prompt_tokens, segments=tuple(segments),
                          finish_reason=script.finish_reason, reward=reward)
        emit(traj)
        return ep.tensors(reward, emul_tokens=torch.tensor(traj.final_length, dtype=torch.int64))
