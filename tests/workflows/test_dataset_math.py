"""DAPO-Math-style generator and the DAPO-Math-17K parquet loader."""

from __future__ import annotations

import ast
import operator
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from areal_libra.workflows.markup import TOOL_INSTRUCTION
from areal_libra.workflows.math_data import (
    DAPO_PREFIX,
    DAPO_SUFFIX,
    DatasetError,
    generate_problems,
    generated_dataset,
    load_dapo_parquet,
    load_math_dataset,
)

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _value(node):
    if isinstance(node, ast.Expression):
        return _value(node.body)
    if isinstance(node, ast.Constant):
        return node.value
    return _OPS[type(node.op)](_value(node.left), _value(node.right))


def test_generator_is_deterministic_and_correct():
    a, b = generate_problems(300, seed=3), generate_problems(300, seed=3)
    assert a == b
    assert generate_problems(300, seed=4) != a
    assert generate_problems(50, seed=3) == a[:50]  # growing the set keeps the first problems
    assert len({p.prompt_id for p in a}) == 300
    for p in a:
        assert p.answer == _value(ast.parse(p.expression, mode="eval"))
        # Fixed widths: 8-symbol expressions, 4-digit answers (see math_data._one_expression).
        assert len(p.expression) == 8 and 1000 <= p.answer <= 9999
    assert {re.sub(r"\d", "9", p.expression) for p in a} == {"99*99+99", "99+99*99", "99*99-99", "(9+9)*99"}


def test_generated_dataset_rows_follow_dapo_format():
    ds = generated_dataset(20, seed=1)
    assert len(ds) == 20 and {"messages", "answer", "prompt_id", "data_source"} <= set(ds.column_names)
    row = ds[0]
    assert row["messages"][0] == {"role": "system", "content": TOOL_INSTRUCTION}
    user = row["messages"][-1]
    assert user["role"] == "user"
    assert user["content"].startswith(DAPO_PREFIX) and user["content"].endswith(DAPO_SUFFIX)
    assert "Answer:" in user["content"] and row["answer"].isdigit()
    plain = generated_dataset(5, seed=1, tool_instruction=False)
    assert [m["role"] for m in plain[0]["messages"]] == ["user"]
    assert list(generated_dataset(20, seed=1)["answer"]) == list(ds["answer"])


def _dapo_table(n: int) -> pa.Table:
    return pa.Table.from_pylist([
        {
            "data_source": "math_dapo",
            "prompt": [{"role": "user", "content": f"{DAPO_PREFIX}Compute {i}+1.{DAPO_SUFFIX}"}],
            "ability": "MATH",
            "reward_model": {"ground_truth": str(i + 1), "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": f"uuid-{i}"},
        }
        for i in range(n)
    ])


def test_dapo_parquet_loads(tmp_path):
    f = tmp_path / "dapo-math-17k.parquet"
    pq.write_table(_dapo_table(7), f)
    ds = load_dapo_parquet(f)
    assert len(ds) == 7
    row = ds[3]
    assert row["answer"] == "4" and row["prompt_id"] == "dapo-uuid-3" and row["data_source"] == "math_dapo"
    assert row["messages"][0]["role"] == "system" and row["messages"][1]["content"].startswith(DAPO_PREFIX)
    assert len(load_math_dataset(str(f), size=5)) == 7  # `size` is the generator's: a file loads every row
    assert len(load_math_dataset(str(f), size=5, max_rows=5)) == 5
    assert len(load_math_dataset(str(tmp_path), size=100)) == 7  # a directory of parquet files
    assert len(load_dapo_parquet(f, tool_instruction=False)[0]["messages"]) == 1


@pytest.mark.parametrize("case", ["missing", "not_parquet", "no_columns", "bad_prompt", "empty_dir"])
def test_dapo_bad_paths_raise_one_clear_error(tmp_path, case):
    f = tmp_path / "data.parquet"
    if case == "not_parquet":
        f.write_text("this is not parquet\n")
    elif case == "no_columns":
        pq.write_table(pa.Table.from_pylist([{"question": "1+1", "answer": "2"}]), f)
    elif case == "bad_prompt":
        pq.write_table(pa.Table.from_pylist([{"prompt": "just text", "reward_model": {"ground_truth": "2"}}]), f)
    elif case == "empty_dir":
        f = tmp_path / "empty"
        f.mkdir()
    with pytest.raises(DatasetError) as err:
        load_math_dataset(str(f))
    msg = str(err.value)
    assert str(f) in msg and "\n" not in msg
    expected = {"missing": "no such", "not_parquet": "not a readable parquet", "no_columns": "prompt, reward_model",
                "bad_prompt": "column 'prompt'", "empty_dir": "no .parquet"}[case]
    assert expected in msg
