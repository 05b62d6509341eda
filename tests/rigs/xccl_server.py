"""A stand-in for SGLang's weight-update endpoints where SGLang cannot run (no GPU): an HTTP server that joins
real torch.distributed gloo groups the way an SGLang server of TP t joins the NCCL one - one process per TP
rank, rank `rank_offset + r` of `world_size`, through AReaL's init_custom_process_group (the same rendezvous
as SGLang's) - and receives the trainer's broadcasts.

    python -m tests.rigs.xccl_server --host H --port P --tp-size T [--refuse-groups]   (launcher arguments)

Endpoints (SGLang 0.5's names and bodies): /health, /model_info, /pause_generation, /continue_generation,
/init_weights_update_group, /update_weights_from_distributed, /destroy_weights_update_group, and
GET /xccl_state (this rig only: the groups it holds - name -> [ranks, world] - and a checksum of every
tensor each rank received, per group). `--refuse-groups`: every /init_weights_update_group fails (a server
that cannot join), to test the fleet's failure path. No generation: the fleet's tests do not route here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# One TP rank: joins the group, then per line on stdin receives one bucket (names/dtypes/shapes) and prints the
# sum of every received tensor; "destroy" leaves.
_RANK = r"""
import datetime, importlib.util, json, os, sys, torch, torch.distributed as dist
# AReaL's init_custom_process_group from its file (torch only), without importing all of areal (slow)
_spec = importlib.util.spec_from_file_location("areal_distributed", os.path.join(
    importlib.util.find_spec("areal").submodule_search_locations[0], "engine", "core", "distributed.py"))
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)
init_custom_process_group = _mod.init_custom_process_group
addr, port, rank, world, name = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
pg = init_custom_process_group(backend="gloo", init_method=f"tcp://{addr}:{port}", world_size=world, rank=rank,
                               group_name=name, timeout=datetime.timedelta(seconds=180))
print("JOINED", flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "destroy":
        break
    sums = []
    for dt, shape in zip(cmd["dtypes"], cmd["shapes"]):
        t = torch.empty(shape, dtype=getattr(torch, dt))
        dist.broadcast(t, src=0, group=pg)
        sums.append(float(t.double().sum()))
    print("GOT " + json.dumps(sums), flush=True)
dist.destroy_process_group(pg)
"""


class _Group:
    def __init__(self, body: dict, tp: int) -> None:
        self.name = body["group_name"]
        self.world = int(body["world_size"])
        self.ranks = [int(body["rank_offset"]) + r for r in range(tp)]
        self.received: list[list[float]] = []
        self.procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(body["master_address"]),
                                        str(body["master_port"]), str(rank), str(self.world), self.name],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                      for rank in self.ranks]

    def _read(self, tag: str) -> list[str]:
        out = []
        for p in self.procs:
            line = p.stdout.readline()
            if not line.startswith(tag):
                raise RuntimeError(f"rank process said {line!r}, expected {tag}")
            out.append(line[len(tag):].strip())
        return out

    def joined(self) -> None:
        self._read("JOINED")

    def receive(self, body: dict) -> None:
        cmd = json.dumps({"op": "recv", "dtypes": body["dtypes"], "shapes": body["shapes"]}) + "\n"
        for p in self.procs:
            p.stdin.write(cmd)
            p.stdin.flush()
        self.received.append([json.loads(x) for x in self._read("GOT")][0])  # rank 0 of the server: its copy

    def destroy(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.stdin.write(json.dumps({"op": "destroy"}) + "\n")
                    p.stdin.flush()
                except OSError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


class _State:
    def __init__(self, tp: int, refuse: bool) -> None:
        self.tp, self.refuse = tp, refuse
        self.groups: dict[str, _Group] = {}
        self.lock = threading.Lock()
        self.paused = 0


def _handler(state: _State):
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a) -> None:  # quiet
            pass

        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, {})
            elif self.path in ("/model_info", "/get_model_info"):
                self._send(200, {"weight_version": "default"})
            elif self.path == "/xccl_state":
                with state.lock:
                    self._send(200, {n: {"ranks": g.ranks, "world": g.world, "received": g.received}
                                     for n, g in state.groups.items()})
            else:
                self._send(404, {"error": self.path})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            try:
                if self.path in ("/pause_generation", "/continue_generation"):
                    state.paused += self.path == "/pause_generation"
                    self._send(200, {"success": True})
                elif self.path == "/init_weights_update_group":
                    if state.refuse:
                        self._send(500, {"success": False, "message": "this server refuses weight-update groups"})
                        return
                    g = _Group(body, state.tp)
                    g.joined()  # blocks until the whole group (trainer included) has met, as SGLang's does
                    with state.lock:
                        state.groups[g.name] = g
                    self._send(200, {"success": True, "message": ""})
                elif self.path == "/update_weights_from_distributed":
                    with state.lock:
                        g = state.groups[body["group_name"]]
                    g.receive(body)
                    self._send(200, {"success": True, "message": ""})
                elif self.path == "/destroy_weights_update_group":
                    with state.lock:
                        g = state.groups.pop(body.get("group_name", "weight_update_group"), None)
                    if g is None:
                        self._send(400, {"success": False, "message": "no such group"})
                        return
                    g.destroy()
                    self._send(200, {"success": True, "message": ""})
                else:
                    self._send(404, {"error": self.path})
            except Exception as e:  # noqa: BLE001 - reported to the client as SGLang would
                self._send(500, {"success": False, "message": f"{type(e).__name__}: {e}"})

    return H


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--refuse-groups", action="store_true")
    p.add_argument("--parent-pid", type=int, default=None)
    a, _ = p.parse_known_args(argv)  # the launcher's other flags (--model-path, --threads, ...) are not used
    state = _State(a.tp_size, a.refuse_groups)
    srv = ThreadingHTTPServer((a.host, a.port), _handler(state))
    srv.daemon_threads = True
    if a.parent_pid:  # leave with the test process, as the embedded server does
        def watch() -> None:
            import time

            while True:
                try:
                    os.kill(a.parent_pid, 0)
                except OSError:
                    os._exit(0)
                time.sleep(1)

        threading.Thread(target=watch, daemon=True).start()
    try:
        srv.serve_forever()
    finally:
        for g in list(state.groups.values()):
            g.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
