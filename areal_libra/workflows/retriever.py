"""The search tool's client side: calls to a Search-R1 style retrieval server, and the server process a
launch starts (health-checked) and stops.

A call's failure (the server down, a 4xx/5xx, a malformed reply) and a timeout are tool outcomes with an
error text as payload, never exceptions, as for the calculator."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from areal_libra.utils import free_port
from areal_libra.workflows.tools import ToolResult

MAX_PASSAGE_CHARS = 200
DEFAULT_TOPK = 2  # passages per search for the tiny model (Search-R1 uses 3 with a 3B+ model)


def _passage(item: object) -> str:
    """One result item: Search-R1 returns {"document": {...}, "score"} with scores, the document without."""
    doc = item.get("document", item) if isinstance(item, dict) else None
    text = doc.get("contents") if isinstance(doc, dict) else None
    if not isinstance(text, str):
        raise ValueError("a result item has no 'contents'")
    return text[:MAX_PASSAGE_CHARS]


def retrieve(url: str, queries: list[str], topk: int, timeout_s: float) -> list[list[str]]:
    """POST /retrieve; the passages of each query, best first. Raises OSError / ValueError on failure."""
    body = json.dumps({"queries": queries, "topk": topk, "return_scores": True}).encode()
    req = urllib.request.Request(url.rstrip("/") + "/retrieve", data=body,
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        reply = json.loads(r.read())
    result = reply.get("result") if isinstance(reply, dict) else None
    if not isinstance(result, list) or len(result) != len(queries) or not all(isinstance(x, list) for x in result):
        raise ValueError("reply has no 'result' list per query")
    return [[_passage(item) for item in row] for row in result]


class RetrieverClient:
    """The `search` tool of a SearchR1Workflow."""

    name = "search"

    def __init__(self, url: str, topk: int = DEFAULT_TOPK, timeout_s: float = 5.0):
        if topk < 1 or timeout_s <= 0:
            raise ValueError(f"topk must be >= 1 and timeout_s > 0, got {topk}, {timeout_s}")
        self.url, self.topk, self.timeout_s = url, topk, timeout_s

    def call(self, query: str) -> ToolResult:
        t0 = time.monotonic()
        try:
            passages = retrieve(self.url, [query], self.topk, self.timeout_s)[0]
        except TimeoutError:
            return ToolResult("timeout", f"TimeoutError: no result within {self.timeout_s:g} s", time.monotonic() - t0)
        except urllib.error.HTTPError as e:
            return ToolResult("failure", f"RetrieverError: HTTP {e.code}", time.monotonic() - t0)
        except urllib.error.URLError as e:
            status = "timeout" if isinstance(e.reason, TimeoutError) else "failure"
            return ToolResult(status, f"RetrieverError: {e.reason}"[:64], time.monotonic() - t0)
        except (OSError, ValueError) as e:
            return ToolResult("failure", f"RetrieverError: {type(e).__name__}", time.monotonic() - t0)
        return ToolResult("success", " ".join(passages), time.monotonic() - t0)

    async def acall(self, query: str) -> ToolResult:
        return await asyncio.to_thread(self.call, query)

    def start(self) -> None:
        """Nothing to start: the server is its own process."""


def is_healthy(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout_s) as r:
            return r.status == 200
    except (OSError, ValueError):
        return False


class RetrieverProcess:
    """The project's BM25 retrieval server as a child process on 127.0.0.1, in its own process group."""

    def __init__(self, log_path: str | Path, port: int | None = None, corpus: str | None = None,
                 timeout_s: float = 60.0):

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        cmd = [sys.executable, "-m", "areal_libra.workflows.retriever_server", "--host", "127.0.0.1",
               "--port", str(self.port)] + (["--corpus", corpus] if corpus else [])
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not is_healthy(self.url):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["(empty log)"]
                raise RuntimeError(f"retrieval server on port {self.port} did not become healthy: {tail[0]}")
            time.sleep(0.2)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
