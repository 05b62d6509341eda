"""Code tasks in miniature (R2E-Gym's shape: write code, run it, graded by hidden tests): a deterministic
generator of one-argument integer functions described as two steps ("add 3, times 2"), with one visible
example and hidden tests, and the reference / miscoded solutions the warm-up demonstrates.

Every function is two straight-line statements on x: `x=x+A`, `x=x-A`, `x=x*A`, `x=x%A`, `x=max(x,A)`,
`x=min(x,A)`, so writing it is a line-by-line translation that a 0.8M-parameter model can learn; mod, max
and min make wrong code right on some inputs, so the fraction of hidden tests passed is a graded reward."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from areal_libra.workflows.code_markup import CODE_CLOSE, CODE_INSTRUCTION, CODE_OPEN
from areal_libra.workflows.math_data import DatasetError

GENERATED_SOURCE = "areal_libra/code"
N_HIDDEN = 6
X_RANGE = (0, 20)

# step name -> (statement template, smallest constant)
OPS: dict[str, tuple[str, int]] = {
    "add": ("x=x+{a}", 1),
    "minus": ("x=x-{a}", 1),
    "times": ("x=x*{a}", 2),
    "mod": ("x=x%{a}", 2),
    "max": ("x=max(x,{a})", 1),
    "min": ("x=min(x,{a})", 1),
}
_CONFUSED = {"add": "minus", "minus": "add", "times": "add", "mod": "minus", "max": "min", "min": "max"}


def apply_op(op: str, a: int, x: int) -> int:
    return {"add": x + a, "minus": x - a, "times": x * a, "mod": x % a, "max": max(x, a), "min": min(x, a)}[op]


@dataclass(frozen=True)
class CodeProblem:
    prompt_id: str
    steps: tuple[tuple[str, int], ...]
    example_x: int
    hidden_xs: tuple[int, ...]

    def f(self, x: int) -> int:
        for op, a in self.steps:
            x = apply_op(op, a, x)
        return x

    @property
    def question(self) -> str:
        spec = ", ".join(f"{op} {a}" for op, a in self.steps)
        return f"Write f(x): {spec}. Example: f({self.example_x}) = {self.f(self.example_x)}"

    @property
    def example(self) -> list[tuple[list[int], int]]:
        return [([self.example_x], self.f(self.example_x))]

    @property
    def hidden_tests(self) -> list[tuple[list[int], int]]:
        return [([x], self.f(x)) for x in self.hidden_xs]


def render_code(steps: tuple[tuple[str, int], ...]) -> str:
    lines = [OPS[op][0].format(a=a) for op, a in steps]
    return "def f(x):\n" + "".join(f" {ln}\n" for ln in lines) + " return x"


def reference_code(p: CodeProblem) -> str:
    return render_code(p.steps)


def miscode(p: CodeProblem, rng: random.Random) -> str:
    """A plausible wrong solution: a constant miscopied, an operation confused, the steps swapped, or a
    syntax slip (the last one fails to run: a tool failure the trace records)."""
    steps = list(p.steps)
    kind = rng.randrange(4)
    i = rng.randrange(len(steps))
    op, a = steps[i]
    if kind == 0:
        steps[i] = (op, rng.choice([b for b in range(OPS[op][1], 10) if b != a]))
    elif kind == 1:
        steps[i] = (_CONFUSED[op], max(a, OPS[_CONFUSED[op]][1]))
    elif kind == 2 and steps[0] != steps[-1]:
        steps.reverse()
    else:
        code = render_code(tuple(steps))
        return code.replace("):\n", ")\n", 1) if rng.random() < 0.5 else code.replace("x=x", "x=", 1)
    return render_code(tuple(steps))


def _one_problem(rng: random.Random, pid: str) -> CodeProblem:
    names = list(OPS)
    steps = []
    for _ in range(2):
        op = rng.choice(names)
        steps.append((op, rng.randint(OPS[op][1], 9)))
    xs = rng.sample(range(X_RANGE[0], X_RANGE[1] + 1), N_HIDDEN + 1)
    return CodeProblem(pid, tuple(steps), xs[0] % 10, tuple(xs[1:]))


def generate_code_problems(n: int, seed: int = 0, id_prefix: str = "code") -> list[CodeProblem]:
    """n problems, identical for the same (n, seed); the first k of n are the problems of generate(k)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(f"areal_libra-code-{seed}")
    return [_one_problem(rng, f"{id_prefix}-{seed}-{i}") for i in range(n)]


def code_messages(p: CodeProblem) -> list[dict[str, str]]:
    return [{"role": "system", "content": CODE_INSTRUCTION}, {"role": "user", "content": p.question}]


def code_rows(problems: list[CodeProblem]) -> list[dict[str, Any]]:
    """Dataset rows: messages, the example and hidden tests as flat int columns (Arrow-friendly)."""
    return [
        {
            "messages": code_messages(p),
            "prompt_id": p.prompt_id,
            "example_input": p.example_x,
            "example_output": p.f(p.example_x),
            "test_inputs": list(p.hidden_xs),
            "test_outputs": [p.f(x) for x in p.hidden_xs],
            "answer": reference_code(p),
            "data_source": GENERATED_SOURCE,
        }
        for p in problems
    ]


def row_tests(row: dict[str, Any]) -> tuple[list[tuple[list[int], int]], list[tuple[list[int], int]]]:
    """(the visible example, the hidden tests) of a dataset row, as sandbox tests."""
    example = [([int(row["example_input"])], int(row["example_output"]))]
    hidden = [([int(x)], int(y)) for x, y in zip(row["test_inputs"], row["test_outputs"])]
    return example, hidden


def load_code_dataset(path: str | None = None, size: int = 4096, seed: int = 0, max_rows: int | None = None):
    """`size` generated code problems as a `datasets.Dataset` (deterministic by seed); only the generator
    exists, so `path` must be None, '' or 'generated'."""
    if path not in (None, "", "generated"):
        raise DatasetError(f"{path}: code_sandbox has no file dataset; use train_dataset.path=generated")
    from datasets import Dataset

    return Dataset.from_list(code_rows(generate_code_problems(size, seed)))


def demonstration_text(code: str) -> str:
    return f"{CODE_OPEN}{code}{CODE_CLOSE}"
