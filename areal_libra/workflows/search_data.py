"""Search-R1's real training data: the NQ / HotpotQA parquet files (Search-R1's `nq_search.py` output, or
FlashRAG's raw split), as rows {messages, answer, prompt_id, data_source} for SearchR1Workflow.

Accepted columns (the public schema): `question` (str) and the golden answers, either FlashRAG's
`golden_answers` (list of str) or Search-R1's `reward_model.ground_truth.target` (list of str); `id` and
`data_source` when present. The prompt is this project's search instruction (the same <search> /
<information> / <answer> markup as Search-R1's own prefix) plus the question; the reward is exact match
against any golden answer (search_markup.exact_match_reward). The corpus the retriever searches is the
user's JSONL of {"id", "contents"} records (`libra.tools.corpus`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from areal_libra.workflows.math_data import DatasetError, _parquet_files, parquet_rows
from areal_libra.workflows.search_corpus import generate_questions, question_messages, questions_to_rows

QUESTION = "question"
ANSWER_COLUMNS = ("golden_answers", "reward_model")


def _columns_problem(names: list[str]) -> str | None:
    if QUESTION not in names:
        return f"missing Search-R1 column 'question' (has {', '.join(names)})"
    if not any(c in names for c in ANSWER_COLUMNS):
        return f"missing Search-R1 column 'golden_answers' or 'reward_model' (has {', '.join(names)})"
    return None


def _read(f: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(f)
    except (OSError, pa.ArrowException) as e:
        raise DatasetError(f"{f}: not a readable parquet file ({str(e).splitlines()[0]})") from None


def check_file(path: str | Path) -> None:
    """The launch's check before anything starts: every file exists, is parquet and has the columns (reads
    the schemas only). Raises DatasetError with one line naming the file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for f in _parquet_files(Path(path)):
        try:
            names = pq.read_schema(f).names
        except (OSError, pa.ArrowException) as e:
            raise DatasetError(f"{f}: not a readable parquet file ({str(e).splitlines()[0]})") from None
        problem = _columns_problem(names)
        if problem:
            raise DatasetError(f"{f}: {problem}")


def _answers(rec: dict[str, Any], where: str) -> list[str]:
    gold = rec.get("golden_answers")
    if gold is None:
        rm = rec.get("reward_model")
        gt = rm.get("ground_truth") if isinstance(rm, dict) else None
        gold = gt.get("target") if isinstance(gt, dict) else gt
    if isinstance(gold, str):
        gold = [gold]
    if hasattr(gold, "tolist"):
        gold = gold.tolist()
    if not isinstance(gold, list) or not gold or not all(isinstance(g, str) for g in gold):
        raise DatasetError(f"{where}: golden answers must be a non-empty list of strings, got {gold!r:.60}")
    return [str(g) for g in gold]


def load_search_parquet(path: str | Path, max_rows: int | None = None):
    """NQ / HotpotQA training rows from a parquet file or a directory of them (every row unless `max_rows`).

    Raises DatasetError naming the file when it is missing, unreadable or lacks the columns."""
    from datasets import Dataset

    def table_of(f: Path):
        table = _read(f)
        problem = _columns_problem(table.column_names)
        if problem:
            raise DatasetError(f"{f}: {problem}")
        return table

    def row(rec: dict, where: str, n: int) -> dict[str, Any]:
        q = rec.get(QUESTION)
        if not isinstance(q, str) or not q.strip():
            raise DatasetError(f"{where}: column 'question' must be a non-empty string")
        source = str(rec.get("data_source") or "search_r1")
        rid = rec.get("id")
        return {"messages": question_messages(q.strip()), "answer": _answers(rec, where),
                "prompt_id": f"{source}-{rid if rid is not None else n}", "data_source": source}

    return Dataset.from_list(parquet_rows(path, table_of, row, max_rows))


def load_search_dataset(path: str | None = None, size: int = 4096, seed: int = 0, max_rows: int | None = None):
    """The training set (libra.dataset.builder of experiment=search_r1): Search-R1's NQ / HotpotQA parquet
    from `path` (every row unless `max_rows`), or `size` generated questions about the generated corpus
    (search_corpus.py) when `path` is None, '' or 'generated'."""
    from datasets import Dataset

    if path not in (None, "", "generated"):
        return load_search_parquet(path, max_rows=max_rows)
    return Dataset.from_list(questions_to_rows(generate_questions(size, seed)))
