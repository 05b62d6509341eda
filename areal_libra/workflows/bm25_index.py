"""A BM25 index over passages (the `bm25s` library), shared by the retrieval server and the warm-up probe."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hit:
    doc_id: str
    contents: str
    score: float


class BM25Index:
    """Lower-cased word tokens, no stopword list (a query word such as 'built' selects a fact)."""

    def __init__(self, records: list[dict[str, str]]):
        import bm25s

        if not records:
            raise ValueError("the corpus is empty")
        self.records = records
        self._bm25s = bm25s
        self._bm25 = bm25s.BM25()
        self._bm25.index(self._tokenize([r["contents"] for r in records]), show_progress=False)

    def __len__(self) -> int:
        return len(self.records)

    def _tokenize(self, texts: list[str]) -> list[list[str]]:
        return self._bm25s.tokenize(texts, stopwords=None, return_ids=False, show_progress=False)

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        """The top-k passages of each query, best first (ties in corpus order, as bm25s breaks them)."""
        if not queries:
            return []
        k = max(1, min(k, len(self.records)))
        docs, scores = self._bm25.retrieve(self._tokenize(queries), k=k, show_progress=False, n_threads=1)
        return [[Hit(self.records[int(d)]["id"], self.records[int(d)]["contents"], float(s))
                 for d, s in zip(row_d, row_s)] for row_d, row_s in zip(docs, scores)]
