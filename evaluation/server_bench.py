"""Throughput of the embedded server over HTTP at several batch sizes.

    python -m evaluation.server_bench [--model-path DIR] [--batch 1 32 128] [--new-tokens 64]
        [--tp 1 2] [--threads K] [--repeats R] [--json]

Without --model-path it builds a random Qwen2 with the embedded default policy's shape (hidden 128,
4 layers, 4 query / 2 key-value heads, MLP 352; 48-token character vocabulary, 0.69M parameters) in a
temporary directory and serves it from a subprocess, as a real run does. For each batch
size B it sends B concurrent /generate requests (sampled, ignore_eos, --new-tokens each) and reports
generated tokens per second of wall time, the mean per-request latency, plus the per-decode-step time the
server measured. With several --tp sizes one server per size runs (threads = its TP unless --threads is
given) and the bursts alternate between them, R times, so all sizes see the same machine load; a summary
line per batch size gives the median per-request latency of each TP and the speed ratio TP1 / TPmax.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time


async def _burst(
    addr: str, prompts: list[list[int]], new_tokens: int, turns: int = 1, tool: list[int] | None = None
) -> tuple[int, float]:
    """Send every conversation at once; (generated tokens, mean per-request latency in seconds)."""
    import aiohttp

    # limit=0: no cap on connections (aiohttp's default 100 would cap the batch), as in AReaL's client
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600), connector=connector) as s:

        async def one(ids: list[int]) -> tuple[int, float]:
            n, t0 = 0, time.perf_counter()
            for _ in range(turns):  # each turn re-sends the conversation, as AReaL's multi-turn workflows do
                body = {
                    "input_ids": ids,
                    "sampling_params": {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True},
                    "return_logprob": True,
                }
                async with s.post(f"http://{addr}/generate", json=body) as r:
                    r.raise_for_status()
                    out = await r.json()
                n += out["meta_info"]["completion_tokens"]
                ids = ids + out["output_ids"] + (tool or [])
            return n, time.perf_counter() - t0

        res = await asyncio.gather(*[one(p) for p in prompts])
        return sum(n for n, _ in res), sum(t for _, t in res) / len(res)


def _server_cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(
    model_path: str,
    batches: list[int],
    new_tokens: int,
    threads: int | None = None,
    turns: int = 1,
    prefix_cache: bool = True,
    tps: list[int] | None = None,
    repeats: int = 1,
) -> list[dict]:
    """Start one embedded server per TP size as subprocesses (as in a real run: client and server in
    separate processes), send the bursts (alternating between servers, ``repeats`` rounds), and read each
    server's own counters from /get_server_info."""
    from transformers import AutoTokenizer

    from areal_libra.rollout.launcher import ServerSpec, launch_servers, shutdown
    from areal_libra.server.inprocess import http

    tok = AutoTokenizer.from_pretrained(model_path)
    extra = () if prefix_cache else ("--prefix-cache-tokens", "0")
    tps = tps or [1]
    specs = [ServerSpec(tp=t, threads=threads, max_running=max(batches), extra_args=extra) for t in tps]
    rows = []
    with tempfile.TemporaryDirectory() as logs:
        handles = launch_servers(model_path, specs, logs, backend="embedded", timeout=300)
        try:
            for h in handles:
                asyncio.run(_burst(h.addr, [tok.encode("warm up ")] * 4, 8))
            for rep in range(repeats):
                for b in batches:
                    prompts = [tok.encode(f"What is {i}+{3 * i}? ") for i in range(b)]
                    # alternate the server order every round so neither always goes first
                    for h in handles if rep % 2 == 0 else handles[::-1]:
                        st0 = http(h.addr, "/get_server_info")[1]["engine_stats"]
                        t0, c0 = time.perf_counter(), _server_cpu_seconds(h.proc.pid)
                        n, lat = asyncio.run(_burst(h.addr, prompts, new_tokens, turns, tok.encode("<r>1234</r> ")))
                        wall, cpu = time.perf_counter() - t0, _server_cpu_seconds(h.proc.pid) - c0
                        st = http(h.addr, "/get_server_info")[1]["engine_stats"]
                        steps = st["decode_steps"] - st0["decode_steps"]
                        rows.append(
                            {
                                "tp": h.spec.tp,
                                "threads": h.spec.n_threads,
                                "repeat": rep,
                                "batch": b,
                                "tokens": n,
                                "wall_s": round(wall, 3),
                                "tokens_per_s": round(n / wall, 1),
                                "request_latency_s": round(lat, 3),
                                "tokens_per_server_cpu_s": round(n / max(cpu, 1e-9), 1),
                                "decode_steps": steps,
                                "ms_per_step": round(
                                    1e3 * (st["busy_seconds"] - st0["busy_seconds"]) / max(steps, 1), 2
                                ),
                                "max_batch": st["max_batch_seen"],
                                "prefilled_tokens": st["prefill_tokens"] - st0["prefill_tokens"],
                                "turns": turns,
                                "prefix_cache": prefix_cache,
                                "loadavg_1m": round(os.getloadavg()[0], 2),
                            }
                        )
        finally:
            shutdown(handles)
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per batch size: median per-request latency and ms/step of each TP, and the speed ratios
    (TP1 latency / TPt latency, > 1 means TPt serves a request faster)."""
    from statistics import median

    out = []
    for b in sorted({r["batch"] for r in rows}):
        by_tp: dict[int, list[dict]] = {}
        for r in rows:
            if r["batch"] == b:
                by_tp.setdefault(r["tp"], []).append(r)
        s: dict = {"summary": True, "batch": b, "repeats": max(len(v) for v in by_tp.values())}
        for tp, rs in sorted(by_tp.items()):
            s[f"tp{tp}_latency_s"] = round(median(r["request_latency_s"] for r in rs), 3)
            s[f"tp{tp}_ms_per_step"] = round(median(r["ms_per_step"] for r in rs), 2)
        tps = sorted(by_tp)
        if len(tps) > 1:
            base = s[f"tp{tps[0]}_latency_s"]
            for tp in tps[1:]:
                s[f"speed_tp{tp}_vs_tp{tps[0]}"] = round(base / max(s[f"tp{tp}_latency_s"], 1e-9), 2)
                # the same ratio within each round (both sizes measured back to back), then the median:
                # less sensitive to load that changes between rounds on a shared machine
                pairs = [
                    a["request_latency_s"] / max(b["request_latency_s"], 1e-9)
                    for a, b in zip(by_tp[tps[0]], by_tp[tp])
                ]
                s[f"paired_speed_tp{tp}_vs_tp{tps[0]}"] = round(median(pairs), 2)
                s[f"rounds_tp{tp}_faster"] = sum(x > 1 for x in pairs)
        out.append(s)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m evaluation.server_bench", description=__doc__.split("\n")[0])
    p.add_argument("--model-path")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--tp", type=int, nargs="+", default=[1], help="one server per TP size (threads = TP)")
    p.add_argument("--threads", type=int, default=None, help="compute threads per server (default: its TP)")
    p.add_argument("--repeats", type=int, default=1, help="rounds of bursts (medians are reported)")
    p.add_argument("--turns", type=int, default=1, help="requests per conversation (multi-turn re-sends)")
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if any(b < 1 for b in a.batch + a.tp) or min(a.new_tokens, a.threads or 1, a.turns, a.repeats) < 1:
        sys.stderr.write(
            "server_bench: error: --batch, --tp, --new-tokens, --threads, --turns and --repeats must be >= 1\n"
        )
        return 2
    if len(set(a.tp)) != len(a.tp):
        sys.stderr.write(f"server_bench: error: --tp sizes must differ, got {a.tp}\n")
        return 2
    if a.model_path and not os.path.isfile(os.path.join(a.model_path, "config.json")):
        sys.stderr.write(f"server_bench: error: --model-path {a.model_path!r} has no config.json\n")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        path = a.model_path
        if path is None:
            from dataclasses import replace

            from areal_libra.models.random_tiny import TinyModelSpec, build_tiny_model
            from areal_libra.models.shape import TINY_QWEN2

            # The default policy's shape, random weights (the random model's untied init and context).
            spec = TinyModelSpec(shape=replace(TINY_QWEN2, max_position_embeddings=2048, tie_word_embeddings=False))
            path = build_tiny_model(os.path.join(tmp, "m"), spec)
        rows = run(path, a.batch, a.new_tokens, a.threads, a.turns, not a.no_prefix_cache, a.tp, a.repeats)
    for r in rows + summarize(rows):
        print(json.dumps(r) if a.json else "  ".join(f"{k}={v}" for k, v in r.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
