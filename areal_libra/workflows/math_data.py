"""DAPO-Math-style data: a deterministic generator of integer-answer arithmetic problems, and a loader for
the real DAPO-Math-17K parquet. Both yield rows {messages, answer, prompt_id, data_source} that
MathToolWorkflow and the reward read."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_libra.workflows.markup import TOOL_INSTRUCTION

# DAPO-Math-17K wraps every problem in this exact text (the reward reads the last "Answer:" line).
DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'

GENERATED_SOURCE = "areal_libra/arith"


class DatasetError(ValueError):
    """A dataset path that is missing or not in the expected format; the message names the file."""


@dataclass(frozen=True)
class MathProblem:
    prompt_id: str
    expression: str
    answer: int

    @property
    def question(self) -> str:
        return f"What is {self.expression}?"


def _one_expression(rng: random.Random) -> tuple[str, int]:
    """An 8-character expression with a 4-digit answer.

    Fixed widths are deliberate: with every expression 8 tokens and every answer 4 digits, copying the
    expression into the tool call and the tool's result into the answer are fixed-offset look-ups that
    a 0.8M-parameter model learns in a few hundred supervised steps on 2 CPU cores (measured: with
    variable widths it had not learned to copy after 300 steps, and RL had no signal)."""
    while True:
        form = rng.randrange(4)
        a, b, c = rng.randint(10, 99), rng.randint(10, 99), rng.randint(10, 99)
        if form == 0:
            expr, ans = f"{a}*{b}+{c}", a * b + c
        elif form == 1:
            expr, ans = f"{a}+{b}*{c}", a + b * c
        elif form == 2:
            expr, ans = f"{a}*{b}-{c}", a * b - c
        else:
            x, y = rng.randint(1, 9), rng.randint(1, 9)
            expr, ans = f"({x}+{y})*{c}", (x + y) * c
        if 1000 <= ans <= 9999:
            return expr, ans


def generate_problems(n: int, seed: int = 0, id_prefix: str = "arith") -> list[MathProblem]:
    """n problems, identical for the same (n, seed); the first k of n are the problems of generate(k)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(f"areal_libra-arith-{seed}")
    out = []
    for i in range(n):
        expr, ans = _one_expression(rng)
        out.append(MathProblem(f"{id_prefix}-{seed}-{i}", expr, ans))
    return out


def dapo_prompt(question: str) -> str:
    return f"{DAPO_PREFIX}{question}{DAPO_SUFFIX}"


def problem_messages(question_text: str, tool_instruction: bool = True) -> list[dict[str, str]]:
    """Chat messages for one problem: an optional system line describing the tool, then the user turn."""
    msgs = [{"role": "system", "content": TOOL_INSTRUCTION}] if tool_instruction else []
    msgs.append({"role": "user", "content": question_text})
    return msgs


def problems_to_rows(problems: list[MathProblem], tool_instruction: bool = True) -> list[dict[str, Any]]:
    return [
        {
            "messages": problem_messages(dapo_prompt(p.question), tool_instruction),
            "answer": str(p.answer),
            "prompt_id": p.prompt_id,
            "data_source": GENERATED_SOURCE,
        }
        for p in problems
    ]


def generated_dataset(n: int = 4096, seed: int = 0, tool_instruction: bool = True):
    """A `datasets.Dataset` of n generated problems (deterministic by seed)."""
    from datasets import Dataset

    return Dataset.from_list(problems_to_rows(generate_problems(n, seed), tool_instruction))


def _parquet_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(path.rglob("*.parquet"))
        if not files:
            raise DatasetError(f"{path}: directory holds no .parquet file")
        return files
    if not path.is_file():
        raise DatasetError(f"{path}: no such dataset file")
    return [path]


def _row_from_dapo(rec: dict[str, Any], where: str, index: int, tool_instruction: bool) -> dict[str, Any]:
    prompt = rec.get("prompt")
    if hasattr(prompt, "tolist"):
        prompt = prompt.tolist()
    if not isinstance(prompt, list) or not prompt:
        raise DatasetError(f"{where}: column 'prompt' must be a non-empty list of {{role, content}} messages")
    messages = []
    for m in prompt:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or not isinstance(m.get("role"), str):
            raise DatasetError(f"{where}: column 'prompt' holds a message without string 'role' and 'content'")
        messages.append({"role": m["role"], "content": m["content"]})
    rm = rec.get("reward_model")
    if not isinstance(rm, dict) or rm.get("ground_truth") is None:
        raise DatasetError(f"{where}: column 'reward_model' must be an object with 'ground_truth'")
    extra = rec.get("extra_info") if isinstance(rec.get("extra_info"), dict) else {}
    pid = extra.get("index")
    if tool_instruction and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": TOOL_INSTRUCTION})
    return {
        "messages": messages,
        "answer": str(rm["ground_truth"]),
        "prompt_id": f"dapo-{pid if pid is not None else index}",
        "data_source": str(rec.get("data_source") or "dapo"),
    }


def load_dapo_parquet(path: str | Path, max_rows: int | None = None, tool_instruction: bool = True):
    """Load DAPO-Math-17K (a parquet file, or a directory of them) as a `datasets.Dataset`.

    Raises DatasetError naming the file when it is missing, unreadable or lacks DAPO's columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset

    def table_of(f: Path):
        try:
            table = pq.read_table(f)
        except (OSError, pa.ArrowException) as e:
            raise DatasetError(f"{f}: not a readable parquet file ({str(e).splitlines()[0]})") from None
        missing = [c for c in ("prompt", "reward_model") if c not in table.column_names]
        if missing:
            raise DatasetError(f"{f}: missing DAPO column(s) {', '.join(missing)} (has {', '.join(table.column_names)})")
        return table

    return Dataset.from_list(parquet_rows(
        path, table_of, lambda rec, where, n: _row_from_dapo(rec, where, n, tool_instruction), max_rows))


def parquet_rows(path: str | Path, table_of: Callable[[Path], Any], row: Callable[[dict, str, int], dict],
                 max_rows: int | None) -> list[dict[str, Any]]:
    """Training rows of a parquet file or a directory of them, in file order: `table_of(file)` reads and checks
    one file (raising DatasetError), `row(record, "FILE: row I", rows_so_far)` makes a row; at most `max_rows`."""
    rows: list[dict[str, Any]] = []
    for f in _parquet_files(Path(path)):
        if max_rows is not None and len(rows) >= max_rows:
            break
        for i, rec in enumerate(table_of(f).to_pylist()):
            rows.append(row(rec, f"{f}: row {i}", len(rows)))
            if max_rows is not None and len(rows) >= max_rows:
                break
    if not rows:
        raise DatasetError(f"{path}: dataset holds no rows")
    return rows


def check_file(path: str | Path) -> None:
    """The launch's check before anything starts: every file exists, is parquet and has DAPO's columns
    (reads the schemas only). Raises DatasetError with one line naming the file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for f in _parquet_files(Path(path)):
        try:
            names = pq.read_schema(f).names
        except (OSError, pa.ArrowException) as e:
            raise DatasetError(f"{f}: not a readable parquet file ({str(e).splitlines()[0]})") from None
        missing = [c for c in ("prompt", "reward_model") if c not in names]
        if missing:
            raise DatasetError(f"{f}: missing DAPO column(s) {', '.join(missing)} (has {', '.join(names)})")


def load_math_dataset(path: str | None = None, size: int = 4096, seed: int = 0, tool_instruction: bool = True,
                      max_rows: int | None = None):
    """The training set: DAPO-Math-17K from `path` when given (every row unless `max_rows`), else `size`
    generated problems. `path` may be None, '' or 'generated' for the generator."""
    if path in (None, "", "generated"):
        return generated_dataset(size, seed, tool_instruction)
    return load_dapo_parquet(path, max_rows=max_rows, tool_instruction=tool_instruction)
