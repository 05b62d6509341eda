"""A retrieval server with Search-R1's HTTP API, over a BM25 index of the generated corpus (or a
Search-R1 style JSONL corpus of {"id", "contents"} records).

    python -m areal_libra.workflows.retriever_server [--host 127.0.0.1] [--port 8000] [--corpus FILE.jsonl]

POST /retrieve {"queries": [...], "topk": k, "return_scores": true}
  -> {"result": [[{"document": {"id", "contents"}, "score": s}, ...], ...]}   (without scores: the documents)
GET /health -> {"status": "ok", "documents": N}. Bad requests get a 4xx and a one-line JSON error.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from areal_libra.workflows.bm25_index import BM25Index, Hit

MAX_BODY = 1 << 20
MAX_QUERIES = 1024
MAX_TOPK = 100
DEFAULT_TOPK = 3  # Search-R1's


class RequestError(ValueError):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def parse_request(body: bytes) -> tuple[list[str], int, bool]:
    """(queries, topk, return_scores) of a /retrieve body; RequestError(4xx) when it is malformed."""
    try:
        req = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise RequestError(400, "body is not JSON") from None
    if not isinstance(req, dict):
        raise RequestError(400, "body must be a JSON object")
    queries = req.get("queries")
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise RequestError(400, "'queries' must be a list of strings")
    if len(queries) > MAX_QUERIES:
        raise RequestError(413, f"at most {MAX_QUERIES} queries per request")
    topk = req.get("topk", DEFAULT_TOPK)
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= MAX_TOPK:
        raise RequestError(400, f"'topk' must be an integer in [1, {MAX_TOPK}]")
    scores = req.get("return_scores", True)
    if not isinstance(scores, bool):
        raise RequestError(400, "'return_scores' must be a boolean")
    return queries, topk, scores


def _record(h: Hit, with_score: bool) -> dict[str, Any]:
    doc = {"id": h.doc_id, "contents": h.contents}
    return {"document": doc, "score": h.score} if with_score else doc


def make_handler(index: BM25Index) -> type[BaseHTTPRequestHandler]:
    lock = threading.Lock()  # bm25s's retrieve is not documented thread-safe; a query costs microseconds

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:  # one line per request is noise at 1k req/s
            pass

        def _send(self, status: int, obj: Any) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str) -> None:
            self._send(status, {"error": message})

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path == "/health":
                self._send(200, {"status": "ok", "documents": len(index)})
            elif self.path == "/retrieve":
                self._error(405, "use POST /retrieve")
            else:
                self._error(404, f"no such path {self.path}")

        def do_POST(self) -> None:  # noqa: N802
            if self.path != "/retrieve":
                self._error(404, f"no such path {self.path}")
                return
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                self.close_connection = True
                self._error(411, "Content-Length required")
                return
            if length < 0 or length > MAX_BODY:
                self.close_connection = True
                self._error(413, f"body over {MAX_BODY} bytes")
                return
            body = self.rfile.read(length)
            try:
                queries, topk, with_scores = parse_request(body)
            except RequestError as e:
                self._error(e.status, str(e))
                return
            with lock:
                hits = index.search(queries, topk)
            self._send(200, {"result": [[_record(h, with_scores) for h in row] for row in hits]})

    return Handler


def load_corpus(path: str | None) -> list[dict[str, str]]:
    """The generated corpus, or a JSONL file of {"id", "contents"} records (ValueError naming the line)."""
    if path is None:
        from areal_libra.workflows.search_corpus import corpus

        return corpus()
    records = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                raise ValueError(f"{path}:{n}: not JSON") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("contents"), str):
                raise ValueError(f"{path}:{n}: a record needs a string 'contents'")
            records.append({"id": str(rec.get("id", len(records))), "contents": rec["contents"]})
    return records


def serve(host: str, port: int, corpus_path: str | None = None) -> ThreadingHTTPServer:
    """A bound server (not yet serving): call serve_forever()."""
    httpd = ThreadingHTTPServer((host, port), make_handler(BM25Index(load_corpus(corpus_path))))
    httpd.daemon_threads = True
    return httpd


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m areal_libra.workflows.retriever_server",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--corpus", help="JSONL of {id, contents} records (default: the generated corpus)")
    args = ap.parse_args(argv)
    if args.corpus is not None and not Path(args.corpus).is_file():
        print(f"error: --corpus {args.corpus}: no such file", file=sys.stderr)
        return 2
    try:
        httpd = serve(args.host, args.port, args.corpus)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(f"retriever: BM25 listening on {args.host}:{httpd.server_address[1]}", flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
