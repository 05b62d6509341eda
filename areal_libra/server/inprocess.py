"""The embedded server inside the current process, on a background event loop.

For tests and benchmarks that need a real server on loopback without a subprocess start-up (importing
torch and transformers again costs ~10 s on a loaded 2-core machine), plus a tiny synchronous client.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from typing import Any

from aiohttp import web

from areal_libra.server.embedded_server import EmbeddedServer, Pacing, ServerArgs, load_model
from areal_libra.utils import free_ports


class InProcessServer:
    """Runs EmbeddedServer's aiohttp app on a background event loop (no subprocess start-up cost)."""

    def __init__(self, model_path: str, pacing: Pacing | None = None, **kwargs: Any):
        """`kwargs`: ServerArgs fields; `pacing`: an emulated accelerator's (areal_libra.rollout.emulation)."""
        port = free_ports(1)[0]
        self.args = ServerArgs(model_path=model_path, port=port, **kwargs)
        model, tok = load_model(model_path)
        self.server = EmbeddedServer(self.args, model, tok, pacing)
        self.tokenizer = tok
        self.addr = f"127.0.0.1:{port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(30)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._runner = web.AppRunner(self.server.app(), access_log=None, handle_signals=False)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", self.args.port)
        self._loop.run_until_complete(site.start())
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(15)

    @property
    def engine(self):
        return self.server.engine


def http(addr: str, path: str, body: Any = None, method: str | None = None, timeout: float = 60) -> tuple[int, Any]:
    """(status, parsed JSON or text) of one request; non-2xx statuses are returned, not raised."""
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(f"http://{addr}{path}", data=data, method=method or ("POST" if data else "GET"))
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw, ctype = r.status, r.read(), r.headers.get_content_type()
    except urllib.error.HTTPError as e:
        status, raw, ctype = e.code, e.read(), e.headers.get_content_type()
    if ctype == "application/json":
        return status, json.loads(raw)
    return status, raw.decode()
