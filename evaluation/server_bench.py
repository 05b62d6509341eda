"""Throughput of the embedded server over HTTP at several batch sizes.

    python -m evaluation.server_bench [--model-path DIR] [--batch 1 32 128] [--new-tokens 64]
        [--threads 1] [--json]

Without --model-path it builds a random Qwen2 with the embedded default policy's shape (hidden 128,
4 layers, 4 query / 2 key-value heads, MLP 352; 48-token character vocabulary, 0.69M parameters) in a
temporary directory and serves it from a subprocess, as a real run does. For each batch
size B it sends B concurrent /generate requests (sampled, ignore_eos, --new-tokens each) and reports
generated tokens per second of wall time, plus the per-decode-step time the server measured.
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
) -> int:
    import aiohttp

    # limit=0: no cap on connections (aiohttp's default 100 would cap the batch), as in AReaL's client
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600), connector=connector) as s:

        async def one(ids: list[int]) -> int:
            n = 0
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
            return n

        return sum(await asyncio.gather(*[one(p) for p in prompts]))


def _server_cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(
    model_path: str, batches: list[int], new_tokens: int, threads: int, turns: int = 1, prefix_cache: bool = True
) -> list[dict]:
    """Start one embedded server as a subprocess (as in a real run: client and server in separate
    processes), send the bursts, read the server's own counters from /get_server_info."""
    from transformers import AutoTokenizer

    from areal_libra.integration.launcher import ServerSpec, launch_servers, shutdown
    from areal_libra.server.inprocess import http

    tok = AutoTokenizer.from_pretrained(model_path)
    extra = () if prefix_cache else ("--prefix-cache-tokens", "0")
    spec = ServerSpec(threads=threads, max_running=max(batches), extra_args=extra)
    rows = []
    with tempfile.TemporaryDirectory() as logs:
        (h,) = launch_servers(model_path, [spec], logs, backend="embedded", timeout=300)
        try:
            asyncio.run(_burst(h.addr, [tok.encode("warm up ")] * 4, 8))
            for b in batches:
                prompts = [tok.encode(f"What is {i}+{3 * i}? ") for i in range(b)]
                st0 = http(h.addr, "/get_server_info")[1]["engine_stats"]
                t0, c0 = time.perf_counter(), _server_cpu_seconds(h.proc.pid)
                n = asyncio.run(_burst(h.addr, prompts, new_tokens, turns, tok.encode("<r>1234</r> ")))
                wall, cpu = time.perf_counter() - t0, _server_cpu_seconds(h.proc.pid) - c0
                st = http(h.addr, "/get_server_info")[1]["engine_stats"]
                steps = st["decode_steps"] - st0["decode_steps"]
                rows.append(
                    {
                        "batch": b,
                        "tokens": n,
                        "wall_s": round(wall, 3),
                        "tokens_per_s": round(n / wall, 1),
                        "tokens_per_server_cpu_s": round(n / max(cpu, 1e-9), 1),
                        "decode_steps": steps,
                        "ms_per_step": round(1e3 * (st["busy_seconds"] - st0["busy_seconds"]) / max(steps, 1), 2),
                        "max_batch": st["max_batch_seen"],
                        "prefilled_tokens": st["prefill_tokens"] - st0["prefill_tokens"],
                        "threads": threads,
                        "turns": turns,
                        "prefix_cache": prefix_cache,
                    }
                )
        finally:
            shutdown([h])
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m evaluation.server_bench", description=__doc__.split("\n")[0])
    p.add_argument("--model-path")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--turns", type=int, default=1, help="requests per conversation (multi-turn re-sends)")
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if any(b < 1 for b in a.batch) or min(a.new_tokens, a.threads, a.turns) < 1:
        sys.stderr.write("bench_server: error: --batch, --new-tokens, --threads and --turns must be >= 1\n")
        return 2
    if a.model_path and not os.path.isfile(os.path.join(a.model_path, "config.json")):
        sys.stderr.write(f"bench_server: error: --model-path {a.model_path!r} has no config.json\n")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        path = a.model_path
        if path is None:
            from areal_libra.models.random_tiny import TinyModelSpec, build_tiny_model

            spec = TinyModelSpec(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=352)
            path = build_tiny_model(os.path.join(tmp, "m"), spec)
        rows = run(path, a.batch, a.new_tokens, a.threads, a.turns, not a.no_prefix_cache)
    load = os.getloadavg()[0]
    for r in rows:
        r["loadavg_1m"] = round(load, 2)
        print(json.dumps(r) if a.json else "  ".join(f"{k}={v}" for k, v in r.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
