"""DAPO answer extraction and equivalence."""

from __future__ import annotations

import pickle

import pytest

from areal_libra.workflows.reward import dapo_math_reward, extract_answer


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Answer: 42", "42"),
        ("<calc>6*7</calc><result>42</result>\nAnswer: 42<|endoftext|>", "42"),
        ("Answer: 1\nsome thought\nAnswer: 7", "7"),  # the last Answer line counts
        ("answer:   $1,234$.", "1234"),
        ("Answer: \\boxed{17}", "17"),
        ("The answer is 5", None),
        ("Answer:", None),
        ("Answer: 3" + "x" * 400, None),  # DAPO reads the last 300 characters only
        ("Answer: -12", "-12"),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "completion, truth, reward",
    [
        ("Answer: 449", "449", 1.0),
        ("Answer: 448", "449", 0.0),
        ("Answer: 449.0", "449", 1.0),
        ("Answer: 0.5", "1/2", 1.0),
        ("Answer: \\frac{1}{2}", "\\frac{1}{2}", 1.0),
        ("Answer: \\frac{2}{4}", "\\frac{1}{2}", 1.0),  # symbolic: math-verify
        ("Answer: \\sqrt{2}", "\\frac{1}{2}", 0.0),
        ("no answer line", "3", 0.0),
        ("Answer: 4<result>9</result>", "4<result>9</result>", 1.0),
        ("<result>449</result>", "449", 0.0),  # the tool result alone is not an answer
    ],
)
def test_reward(completion, truth, reward):
    assert dapo_math_reward("prompt", completion, [], [], truth, messages=[], prompt_id="x") == reward


def test_reward_is_picklable():
    fn = pickle.loads(pickle.dumps(dapo_math_reward))
    assert fn("", "Answer: 3", [], [], "3") == 1.0
