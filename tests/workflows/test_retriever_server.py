"""The retrieval server as a real process: Search-R1's POST /retrieve answered from a BM25 index of the
generated corpus (scores checked against the BM25 formula), 4xx on bad requests, and the client's failures
as tool outcomes."""

from __future__ import annotations

import http.client
import json
import math
from urllib.parse import urlparse

import pytest

from areal_libra.workflows.retriever import RetrieverClient, RetrieverProcess, retrieve
from areal_libra.workflows.search_corpus import corpus, generate_questions


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = RetrieverProcess(tmp_path_factory.mktemp("retriever") / "retriever.log")
    yield proc
    proc.stop()


def _post(url: str, body: bytes, path: str = "/retrieve", method: str = "POST", headers: dict | None = None):
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _tokens(text: str) -> list[str]:
    return [w for w in "".join(c.lower() if c.isalnum() else " " for c in text).split() if len(w) > 1]


def _bm25(query: str, docs: list[str], k1: float = 1.5, b: float = 0.75) -> list[float]:
    """Lucene's BM25 written out (bm25s's default variant, which leaves out the rank-neutral (k1 + 1) factor),
    as an independent check of the scores."""
    toks = [_tokens(d) for d in docs]
    avgdl = sum(map(len, toks)) / len(toks)
    df: dict[str, int] = {}
    for t in toks:
        for w in set(t):
            df[w] = df.get(w, 0) + 1
    out = []
    for t in toks:
        s = 0.0
        for w in set(_tokens(query)):
            tf = t.count(w)
            if tf:
                idf = math.log(1 + (len(toks) - df[w] + 0.5) / (df[w] + 0.5))
                s += idf * tf / (tf + k1 * (1 - b + b * len(t) / avgdl))
        out.append(s)
    return out


def test_topk_passages_are_bm25s_best(server):
    docs = [r["contents"] for r in corpus()]
    qs = generate_questions(8, seed=3)
    status, body = _post(server.url, json.dumps({"queries": [q.query for q in qs], "topk": 3}).encode())
    assert status == 200
    result = json.loads(body)["result"]
    assert len(result) == len(qs)
    for q, hits in zip(qs, result):
        assert len(hits) == 3
        # The question's own query ranks the passage holding its answer first.
        top = hits[0]["document"]["contents"]
        assert q.entity.name.capitalize() in top and q.answer in top
        # Scores are BM25's (the formula, computed here independently) and come best first.
        want = _bm25(q.query, docs)
        got = [h["score"] for h in hits]
        assert got == sorted(got, reverse=True)
        assert got[0] == pytest.approx(max(want), rel=1e-4)
        for h in hits:
            assert h["score"] == pytest.approx(want[int(h["document"]["id"])], rel=1e-4)


def test_topk_and_formats(server):
    q = generate_questions(1, seed=4)[0]
    for k in (1, 2, 5):
        assert [len(r) for r in retrieve(server.url, [q.query, "tower"], k, 10.0)] == [k, k]
    status, body = _post(server.url, json.dumps({"queries": [q.query], "topk": 1, "return_scores": False}).encode())
    assert status == 200 and set(json.loads(body)["result"][0][0]) == {"id", "contents"}
    status, body = _post(server.url, json.dumps({"queries": []}).encode())
    assert status == 200 and json.loads(body)["result"] == []


@pytest.mark.parametrize("body,status", [
    (b"not json", 400),
    (b"[1, 2]", 400),
    (b'{"topk": 2}', 400),
    (b'{"queries": "a query"}', 400),
    (b'{"queries": [1, 2]}', 400),
    (b'{"queries": ["q"], "topk": 0}', 400),
    (b'{"queries": ["q"], "topk": 101}', 400),
    (b'{"queries": ["q"], "topk": true}', 400),
    (b'{"queries": ["q"], "topk": "2"}', 400),
    (b'{"queries": ["q"], "return_scores": "yes"}', 400),
    (json.dumps({"queries": ["q"] * 1025}).encode(), 413),
])
def test_bad_requests_get_4xx(server, body, status):
    got, reply = _post(server.url, body)
    assert got == status and "error" in json.loads(reply)


def test_bad_paths_and_methods(server):
    assert _post(server.url, b"{}", path="/nope")[0] == 404
    assert _post(server.url, b"", path="/retrieve", method="GET")[0] == 405
    assert _post(server.url, b"x" * 10, headers={"Content-Length": str((1 << 20) + 1)})[0] == 413
    assert _post(server.url, b"", path="/health", method="GET")[0] == 200
    assert server.alive()


def test_client_failures_are_outcomes(server, tmp_path):
    client = RetrieverClient(server.url, topk=2, timeout_s=5.0)
    res = client.call(generate_questions(1, seed=5)[0].query)
    assert res.status == "success" and res.payload.count(".") == 2
    dead = RetrieverClient("http://127.0.0.1:9", timeout_s=2.0).call("q")  # nothing listens on port 9
    assert dead.status == "failure" and dead.payload.startswith("RetrieverError")
    assert RetrieverClient(server.url + "/nope", timeout_s=2.0).call("q").status == "failure"


def test_process_stops_and_bad_corpus_fails_in_one_line(tmp_path):
    proc = RetrieverProcess(tmp_path / "a.log")
    proc.stop()
    assert not proc.alive()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1}\n')
    with pytest.raises(RuntimeError, match="bad.jsonl:1"):
        RetrieverProcess(tmp_path / "b.log", corpus=str(bad), timeout_s=20)
