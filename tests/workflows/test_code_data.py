"""The code task generator and its warm-up demonstrations: deterministic, the reference passes every hidden
test in the sandbox, miscoded attempts fail some, and the in-process demonstration outputs are exactly the
text the sandbox gives the model in a live episode."""

from __future__ import annotations

import random

import pytest

from areal_libra.models.code_task import PARAMS, demonstration, local_run
from areal_libra.models.warmup import WarmupConfig
from areal_libra.workflows.code_data import (
    DatasetError,
    generate_code_problems,
    load_code_dataset,
    miscode,
    reference_code,
    row_tests,
)
from areal_libra.workflows.code_markup import extract_code, format_output, last_code
from areal_libra.workflows.sandbox import grade, run_example


def test_generator_is_deterministic_and_prefix_stable():
    a, b = generate_code_problems(50, seed=3), generate_code_problems(50, seed=3)
    assert a == b and generate_code_problems(10, seed=3) == a[:10]
    assert a != generate_code_problems(50, seed=4)
    assert len({p.question for p in a}) > 40


def test_reference_passes_and_miscodes_mostly_fail():
    rng = random.Random(0)
    problems = generate_code_problems(60, seed=1)
    fractions = []
    for p in problems:
        assert grade(reference_code(p), p.hidden_tests) == 1.0, p
        fractions.append(grade(miscode(p, rng), p.hidden_tests))
    assert sum(f < 1.0 for f in fractions) > 0.8 * len(fractions)  # a few miscodes happen to be equivalent
    assert any(0.0 < f < 1.0 for f in fractions)  # partial credit exists


def test_demonstration_outputs_match_the_sandbox():
    rng = random.Random(1)
    for p in generate_code_problems(40, seed=2):
        code = reference_code(p) if rng.random() < 0.5 else miscode(p, rng)
        assert local_run(code, p)[0] == format_output(run_example(code, p.example)[1]), code


def test_demonstrations_retry_only_after_a_wrong_run():
    rng = random.Random(2)
    n_retry = 0
    for p in generate_code_problems(200, seed=5):
        demo = demonstration(p, rng, WarmupConfig())
        texts = [t for t, _ in demo]
        assert [trained for _, trained in demo] == [True, False] * (len(demo) // 2)
        assert extract_code(texts[0]) is not None and last_code("".join(texts)) is not None
        if len(demo) == 4:
            n_retry += 1
            assert not texts[1].endswith(" ok</out>")
    share_wrong_first = PARAMS["miscode_first"]
    assert 0.1 * 200 < n_retry < share_wrong_first * 200


def test_dataset_rows_and_bad_path():
    ds = load_code_dataset(None, 8, seed=1)
    row = ds[0]
    example, hidden = row_tests(row)
    p = generate_code_problems(8, seed=1)[0]
    assert example == p.example and hidden == p.hidden_tests and row["prompt_id"] == p.prompt_id
    with pytest.raises(DatasetError, match="generated"):
        load_code_dataset("/no/such.parquet", 8)


def test_every_workflow_parses_its_trailing_tool_call_with_one_rule() -> None:
    """markup.trailing_call serves the calculator, the search and the code parsers: only a call the text
    ends with counts; the calculator and search strip the body, code keeps its indentation."""
    from areal_libra.workflows.markup import extract_call
    from areal_libra.workflows.search_markup import extract_query

    assert extract_call("so <calc> 2+3 </calc>  ") == "2+3"
    assert extract_call("<calc>2+3</calc> and more") is None and extract_call("2+3</calc>") is None
    assert extract_query("x <search> capital of Zed </search>") == "capital of Zed"
    assert extract_query("<search>q</search><information>p</information>") is None
    assert extract_code("<py>\n    return 1\n</py>") == "\n    return 1\n"
    assert extract_code("<py>x</py> trailing text") is None
