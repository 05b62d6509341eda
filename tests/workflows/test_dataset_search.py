"""Search-R1's real data: NQ / HotpotQA training parquet in the public schemas (Search-R1's nq_search.py output
and FlashRAG's raw split), a user corpus in Search-R1's JSONL format served by the project's BM25 server,
and the launch's one-line errors for bad input (exit 2 before anything starts)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from areal_libra import launch
from areal_libra.workflows.math_data import DatasetError
from areal_libra.workflows.search_data import check_file, load_search_dataset, load_search_parquet
from areal_libra.workflows.search_markup import SEARCH_INSTRUCTION, exact_match_reward

QA = [("who wrote the novel dracula", ["Bram Stoker"], "nq"),
      ("what is the capital city of australia", ["Canberra"], "nq"),
      ("which river flows through the city of vienna", ["Danube", "the Danube River"], "hotpotqa")]
CORPUS = [{"id": "1", "contents": "\"Dracula\"\nDracula is an 1897 Gothic horror novel by Bram Stoker."},
          {"id": "2", "contents": "\"Canberra\"\nCanberra is the capital city of Australia."},
          {"id": "3", "contents": "\"Vienna\"\nVienna lies on the Danube river in eastern Austria."},
          {"id": "4", "contents": "\"Sydney\"\nSydney is the largest city of Australia."}]


def _searchr1_table(rows=QA) -> pa.Table:
    """Search-R1's scripts/data_process/nq_search.py output: FlashRAG's columns kept, the verl ones added."""
    return pa.Table.from_pylist([
        {"id": f"train_{i}", "question": q, "golden_answers": gold, "data_source": src,
         "prompt": [{"role": "user", "content": f"Answer the given question. ... Question: {q}?\n"}],
         "ability": "fact-reasoning",
         "reward_model": {"style": "rule", "ground_truth": {"target": gold}},
         "extra_info": {"split": "train", "index": i}}
        for i, (q, gold, src) in enumerate(rows)
    ])


def _verl_only_table() -> pa.Table:
    """The same rows with only question + the verl columns (answers under reward_model.ground_truth.target)."""
    return pa.Table.from_pylist([
        {"question": q, "data_source": src, "reward_model": {"style": "rule", "ground_truth": {"target": gold}}}
        for q, gold, src in QA
    ])


def _flashrag_table() -> pa.Table:
    return pa.Table.from_pylist([{"id": str(i), "question": q, "golden_answers": gold}
                                 for i, (q, gold, _) in enumerate(QA)])


@pytest.mark.parametrize("schema", ["searchr1", "verl_only", "flashrag"])
def test_the_public_schemas_load(tmp_path, schema):
    table = {"searchr1": _searchr1_table, "verl_only": _verl_only_table, "flashrag": _flashrag_table}[schema]()
    f = tmp_path / "train.parquet"
    pq.write_table(table, f)
    check_file(f)
    ds = load_search_dataset(str(f), size=1)  # `size` is the generator's; a file loads every row
    assert len(ds) == len(QA)
    for row, (q, gold, src) in zip(ds, QA):
        assert row["messages"] == [{"role": "system", "content": SEARCH_INSTRUCTION}, {"role": "user", "content": q}]
        assert row["answer"] == gold
        assert row["data_source"] == (src if schema != "flashrag" else "search_r1")
    assert len({r["prompt_id"] for r in ds}) == len(QA)
    # The reward reads the row's list of golden answers: any of them, after Search-R1's normalisation.
    assert exact_match_reward(None, "<answer>the danube river</answer>", None, None, ds[2]["answer"]) == 1.0
    assert exact_match_reward(None, "<answer>Danube</answer>", None, None, ds[2]["answer"]) == 1.0
    assert exact_match_reward(None, "<answer>Rhine</answer>", None, None, ds[2]["answer"]) == 0.0


def test_max_rows_and_directories(tmp_path):
    pq.write_table(_searchr1_table(QA[:2]), tmp_path / "nq.parquet")
    pq.write_table(_searchr1_table(QA[2:]), tmp_path / "hotpotqa.parquet")
    assert len(load_search_parquet(tmp_path)) == 3
    assert len(load_search_parquet(tmp_path, max_rows=2)) == 2
    assert len(load_search_dataset(None, size=7, seed=1)) == 7  # the generator stays the default


@pytest.mark.parametrize("case", ["missing", "not_parquet", "no_question", "no_answers", "bad_answers",
                                  "empty_dir"])
def test_bad_files_raise_one_clear_error(tmp_path, case):
    f = tmp_path / "train.parquet"
    if case == "not_parquet":
        f.write_text("question,answer\n")
    elif case == "no_question":
        pq.write_table(pa.Table.from_pylist([{"query": "q", "golden_answers": ["a"]}]), f)
    elif case == "no_answers":
        pq.write_table(pa.Table.from_pylist([{"question": "q", "answer": "a"}]), f)
    elif case == "bad_answers":
        pq.write_table(pa.Table.from_pylist([{"question": "q", "golden_answers": []}]), f)
    elif case == "empty_dir":
        f = tmp_path / "empty"
        f.mkdir()
    with pytest.raises(DatasetError) as err:
        load_search_parquet(f)
    msg = str(err.value)
    assert str(f) in msg and "\n" not in msg
    expected = {"missing": "no such", "not_parquet": "not a readable parquet", "no_question": "'question'",
                "no_answers": "'golden_answers' or 'reward_model'", "bad_answers": "golden answers",
                "empty_dir": "no .parquet"}[case]
    assert expected in msg
    if case != "bad_answers":  # the launch's schema-only check catches the same files
        with pytest.raises(DatasetError, match=expected.replace("(", r"\(")):
            check_file(f)


def test_retriever_serves_the_user_corpus(tmp_path):
    """The project's BM25 server (a real child process) over a Search-R1 JSONL corpus: each question's
    passage ranks first."""
    from areal_libra.config import compose
    from areal_libra.launch import start_retriever
    from areal_libra.workflows.retriever import retrieve

    corpus = tmp_path / "wiki.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in CORPUS))
    c = compose(["experiment=search_r1", f"libra.tools.corpus={corpus}"])
    proc = start_retriever(c, tmp_path)
    try:
        got = retrieve(c.libra.tools.retriever_url, [q for q, _, _ in QA], 1, timeout_s=10.0)
    finally:
        proc.stop()
    assert [g[0] for g in got] == [CORPUS[0]["contents"], CORPUS[1]["contents"], CORPUS[2]["contents"]]


@pytest.mark.parametrize("case", ["missing_data", "wrong_columns", "missing_corpus", "bad_corpus",
                                  "dapo_wrong_columns"])
def test_launch_rejects_bad_input_in_one_line(tmp_path, capsys, case):
    data, corpus = tmp_path / "train.parquet", tmp_path / "wiki.jsonl"
    pq.write_table(_searchr1_table(), data)
    corpus.write_text("".join(json.dumps(r) + "\n" for r in CORPUS))
    # A model path that does not exist: should a check let bad input through, the launch still stops here
    # (with another message) instead of building a model and starting a run.
    no_model = f"actor.path={tmp_path / 'no-model'}"
    args = ["experiment=search_r1", f"cluster.fileroot={tmp_path}", no_model]
    if case == "missing_data":
        data = tmp_path / "nope.parquet"
    elif case in ("wrong_columns", "dapo_wrong_columns"):
        pq.write_table(pa.Table.from_pylist([{"text": "q"}]), data)
    elif case == "missing_corpus":
        corpus = tmp_path / "nope.jsonl"
    elif case == "bad_corpus":
        corpus.write_text('{"id": "1", "text": "no contents"}\n')
    if case == "dapo_wrong_columns":
        args = ["experiment=dapo_math", f"cluster.fileroot={tmp_path}", no_model, f"train_dataset.path={data}"]
    else:
        args += [f"train_dataset.path={data}", f"libra.tools.corpus={corpus}"]
    assert launch.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("areal_libra: error:")
    expected = {"missing_data": "no such file", "wrong_columns": "'question'", "missing_corpus": "no such file",
                "bad_corpus": "'contents'", "dapo_wrong_columns": "prompt, reward_model"}[case]
    assert expected in err
    assert not (tmp_path / "logs").exists()  # nothing started
