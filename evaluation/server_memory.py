"""Does an embedded rollout server's memory plateau or keep growing? One real server, driven for N minutes.

    python -m evaluation.server_memory [--minutes 12] [--model-path DIR] [--prompts 16] [--samples 8]
        [--turns 3] [--new-tokens 48] [--pause-s 1.0] [--sample-s 3] [--no-weight-update] [--out FILE.json]

Starts ONE embedded server (a subprocess, as the launcher starts it for a real run; TP 1, max_running 256
as experiments/cluster/cpu.yaml) on the cached tiny math model (~/.cache/areal_libra/models/tiny-qwen2-math-*;
else a random tiny Qwen2 is built) and replays dapo_math-shaped steps: PROMPTS distinct math prompts x SAMPLES
samples each sent at once (identical prompts share a prefill), each an episode of up to TURNS turns that
stops at </calc>, appends a <result>...</result> tool return and re-sends the whole conversation (prefix-cache
reuse, as MathToolWorkflow does); after every step a /update_weights_from_disk to a fresh versioned checkpoint
directory (weight_update_v<N>, alternating between two weight sets), as the trainer does every step.
Every SAMPLE_S seconds it records the server's RSS (/proc) and its KV-cache bytes (/get_server_info).

Reports the RSS series, the plateau (median RSS of the last third), the time to reach it (first sample from
which RSS stays within the plateau band), the least-squares slope of the second half (MiB/min), and
evaluation.soak's flat check applied to the whole life. Exit 0 if the second-half growth is within the soak's
limit, 1 if not, 2 on bad input.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import glob
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time

from evaluation.soak import FLAT_ABS_MIB, FLAT_REL, flat_check, rss_mib


def _slope_mib_per_min(pts: list[tuple[float, float]]) -> float:
    n = len(pts)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in pts) / n
    my = sum(y for _, y in pts) / n
    var = sum((t - mt) ** 2 for t, _ in pts)
    return 60.0 * sum((t - mt) * (y - my) for t, y in pts) / var if var > 0 else 0.0


def analyse(series: list[tuple[float, float]]) -> dict:
    """Plateau level (median of the last third); warm-up end (time to plateau): the first sample that is
    within the soak's limit (max(5% of the plateau, 32 MiB)) of the plateau and from which on the
    least-squares growth of the rest of the run is within that limit; second-half slope; and the soak's own
    flat check (first quarter dropped) over the whole life."""
    ys = [y for _, y in series]
    tail = sorted(ys[len(ys) * 2 // 3:])
    plateau = tail[len(tail) // 2]
    limit = max(FLAT_REL * plateau, FLAT_ABS_MIB)
    reach = None
    for i in range(len(series) - 3):
        rest = series[i:]
        growth = _slope_mib_per_min(rest) * (rest[-1][0] - rest[0][0]) / 60.0
        if series[i][1] >= plateau - limit and growth <= limit:
            reach = series[i][0] - series[0][0]
            break
    half = series[len(series) // 2:]
    slope = _slope_mib_per_min(half)
    span_min = (half[-1][0] - half[0][0]) / 60.0
    return {
        "plateau_mib": round(plateau, 1),
        "limit_mib": round(limit, 1),
        "time_to_plateau_s": None if reach is None else round(reach, 1),
        "peak_mib": round(max(ys), 1),
        "second_half_slope_mib_per_min": round(slope, 2),
        "second_half_growth_mib": round(slope * span_min, 1),
        "flat_second_half": slope * span_min <= limit,
        "soak_flat_check_whole_life": flat_check(series),
    }


def with_analysis(res: dict) -> dict:
    """``res`` (a run's result) with its analysis (re)computed from its series and step end times."""
    a = analyse([(t, y) for t, y, *_ in res["series"]])
    ends = res.get("step_ends_s", [])
    # in steps too: a real run steps slower (the trainer's time), and the allocator warms up per step's shapes
    a["steps_to_plateau"] = None if a["time_to_plateau_s"] is None or not ends else bisect.bisect_right(
        ends, a["time_to_plateau_s"])
    return {**res, "analysis": a}


def _model_path(arg: str | None) -> str:
    if arg:
        if not os.path.isfile(os.path.join(arg, "config.json")):
            raise ValueError(f"--model-path {arg!r} is not a Hugging Face model directory (no config.json)")
        return arg
    cached = sorted(glob.glob(os.path.expanduser("~/.cache/areal_libra/models/tiny-qwen2-math-*")))
    if cached:
        return cached[0]
    from areal_libra.models.random_tiny import build_tiny_model

    return build_tiny_model(tempfile.mkdtemp(prefix="server_memory_model_"))


def _perturbed_copy(model: str, dst: str) -> str:
    """The checkpoint at ``model`` with every weight nudged, saved (with its tokenizer files) to ``dst``."""
    import torch
    from transformers import AutoModelForCausalLM

    shutil.copytree(model, dst)
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for t in m.parameters():
            t.add_(0.01 * torch.randn(t.shape, generator=g))
    m.save_pretrained(dst)
    return dst


def _prompt(rng: random.Random) -> str:
    a, b, c = rng.randint(1, 999), rng.randint(1, 999), rng.randint(1, 99)
    pad = " please" * rng.randint(0, 12)  # varied prompt lengths
    return f"Question{pad}: what is {a}*{c}+{b}? Use <calc> for arithmetic. Answer: "


async def _step(session, addr: str, tok, prompts: list[str], samples: int, turns: int, new_tokens: int,
                stop_ids: list[int], result_ids: list[int], seed: int, max_tokens: int) -> dict:
    counts = {"requests": 0, "tokens": 0, "cached": 0}

    async def episode(ids: list[int], k: int) -> None:
        for turn in range(turns):
            body = {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": min(new_tokens, max(1, max_tokens - len(ids))),
                                    "temperature": 1.0, "stop_token_ids": stop_ids},
                "return_logprob": True,
                "rid": f"s{seed}-{k}-{turn}",
            }
            async with session.post(f"http://{addr}/generate", json=body) as r:
                r.raise_for_status()
                out = await r.json()
            counts["requests"] += 1
            counts["tokens"] += out["meta_info"]["completion_tokens"]
            counts["cached"] += out["meta_info"].get("cached_tokens", 0)
            ids = ids + out["output_ids"]
            if not out["output_ids"] or out["output_ids"][-1] != stop_ids[0] or len(ids) >= max_tokens:
                return  # the answer (or the length limit) ends the episode
            ids = ids + result_ids

    jobs = [episode(tok.encode(p), i * samples + j) for i, p in enumerate(prompts) for j in range(samples)]
    await asyncio.gather(*jobs)
    return counts


def _sampler(pid: int, addr: str, t0: float, sample_s: float, out: list, debug: list,
             stop: threading.Event) -> None:
    from areal_libra.server.inprocess import http

    while not stop.is_set():
        rss = rss_mib(pid)
        if rss is None:
            return
        dbg = None
        try:
            info = http(addr, "/get_server_info")[1]
            kv = info.get("kv_cache_bytes", 0) / 2**20
            dbg = info.get("memory_debug")
        except Exception:  # a busy or restarting server: keep the RSS sample
            kv = None
        out.append((round(time.time() - t0, 1), round(rss, 1), None if kv is None else round(kv, 1)))
        if dbg is not None:
            debug.append({"t": out[-1][0], "rss_mib": out[-1][1], **dbg})
        stop.wait(sample_s)


def run(args: argparse.Namespace) -> dict:
    import aiohttp
    from transformers import AutoTokenizer

    from areal_libra.rollout.launcher import ServerSpec, launch_servers, shutdown
    from areal_libra.server.inprocess import http

    model = _model_path(args.model_path)
    tok = AutoTokenizer.from_pretrained(model)
    close = tok.encode("</calc>")
    stop_ids = [close[0] if len(close) == 1 else tok.eos_token_id]
    if tok.eos_token_id is not None and tok.eos_token_id not in stop_ids:
        stop_ids.append(tok.eos_token_id)
    result_ids = tok.encode("<result>42</result> ")
    work = tempfile.mkdtemp(prefix="server_memory_")
    weights = []
    if not args.no_weight_update:  # a second weight set (same shape, perturbed), so an update really swaps
        weights = [model, _perturbed_copy(model, os.path.join(work, "alt"))]
    series: list[tuple[float, float, float | None]] = []
    debug: list[dict] = []
    env = dict(os.environ)
    for kv in args.server_env:
        k, _, v = kv.partition("=")
        env[k] = v
    if args.debug_memory:
        env["AREAL_LIBRA_MEM_DEBUG"] = "1"
    stop = threading.Event()
    rng = random.Random(0)
    step_ends: list[float] = []
    steps, totals, updates = 0, {"requests": 0, "tokens": 0, "cached": 0}, 0
    handles = launch_servers(model, [ServerSpec(tp=1, max_running=256)], os.path.join(work, "logs"),
                             backend="embedded", timeout=300, env=env)
    t0 = time.time()
    sampler = threading.Thread(target=_sampler, args=(handles[0].proc.pid, handles[0].addr, t0, args.sample_s,
                                                      series, debug, stop), daemon=True)
    sampler.start()
    addr = handles[0].addr
    try:
        async def drive() -> None:
            nonlocal steps, updates
            conn = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600), connector=conn) as s:
                while time.time() - t0 < args.minutes * 60:
                    prompts = [_prompt(rng) for _ in range(args.prompts)]
                    c = await _step(s, addr, tok, prompts, args.samples, args.turns, args.new_tokens, stop_ids,
                                    result_ids, steps, args.max_tokens)
                    for k in totals:
                        totals[k] += c[k]
                    steps += 1
                    step_ends.append(round(time.time() - t0, 1))
                    if weights:
                        # the trainer writes a fresh versioned directory every step and deletes the old one
                        d = os.path.join(work, f"weight_update_v{steps}")
                        shutil.copytree(weights[steps % 2], d)
                        async with s.post(f"http://{addr}/update_weights_from_disk", json={"model_path": d}) as r:
                            if r.status != 200:
                                raise RuntimeError(f"weight update failed: {await r.text()}")
                        updates += 1
                        shutil.rmtree(os.path.join(work, f"weight_update_v{steps - 1}"), ignore_errors=True)
                    if steps % 10 == 0:
                        last = series[-1] if series else None
                        print(f"[server_memory] t={time.time() - t0:.0f}s step {steps} requests "
                              f"{totals['requests']} rss {last[1] if last else '?'} MiB", flush=True)
                    await asyncio.sleep(args.pause_s)  # the trainer's own time between steps

        asyncio.run(drive())
        info = http(addr, "/get_server_info")[1]
    finally:
        stop.set()
        sampler.join(timeout=10)
        shutdown(handles)
        shutil.rmtree(work, ignore_errors=True)
    return with_analysis({
        "command": "python -m evaluation.server_memory " + " ".join(sys.argv[1:]),
        "model": model,
        "minutes": args.minutes,
        "steps": steps,
        "weight_updates": updates,
        **totals,
        "engine_stats": info.get("engine_stats", {}),
        "gc_after_update": info.get("gc_after_update", {}),
        "kv_cache_mib_end": round(info.get("kv_cache_bytes", 0) / 2**20, 1),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "step_ends_s": step_ends,
        "server_env": args.server_env,
        "series": series,
        "memory_debug": debug,
    })


def _write(path: str, res: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m evaluation.server_memory", description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=12.0)
    p.add_argument("--model-path", default=None)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--pause-s", type=float, default=1.0)
    p.add_argument("--sample-s", type=float, default=3.0)
    p.add_argument("--no-weight-update", action="store_true")
    p.add_argument("--debug-memory", action="store_true",
                   help="run the server with AREAL_LIBRA_MEM_DEBUG=1 and record its allocator/Python/cache figures")
    p.add_argument("--server-env", action="append", default=[], metavar="K=V",
                   help="extra environment for the server (e.g. MALLOC_ARENA_MAX=2); repeatable")
    p.add_argument("--out", default=None)
    p.add_argument("--analyse", default=None, metavar="RESULT_JSON",
                   help="no server: recompute the analysis of a saved result (rewrites the file)")
    args = p.parse_args(argv)
    if args.analyse:
        try:
            with open(args.analyse) as f:
                res = with_analysis(json.load(f))
        except (OSError, ValueError, KeyError) as e:
            print(f"server_memory: error: cannot read {args.analyse}: {e}", file=sys.stderr)
            return 2
        _write(args.analyse, res)
        print(json.dumps(res["analysis"], indent=1))
        return 0 if res["analysis"]["flat_second_half"] else 1
    if any("=" not in kv for kv in args.server_env):
        print("server_memory: error: --server-env takes K=V", file=sys.stderr)
        return 2
    if args.minutes <= 0 or args.prompts < 1 or args.samples < 1 or args.turns < 1 or args.sample_s <= 0:
        print("server_memory: error: --minutes, --sample-s must be > 0; --prompts, --samples, --turns >= 1",
              file=sys.stderr)
        return 2
    try:
        res = run(args)
    except ValueError as e:
        print(f"server_memory: error: {e}", file=sys.stderr)
        return 2
    a = res["analysis"]
    print(json.dumps({k: v for k, v in res.items() if k != "series"}, indent=1))
    if args.out:
        _write(args.out, res)
    return 0 if a["flat_second_half"] else 1


if __name__ == "__main__":
    sys.exit(main())
