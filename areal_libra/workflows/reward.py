"""DAPO-Math reward: extract the last "Answer: ..." line, then compare it to the ground truth (exact or
numeric fast path, math-verify for symbolic answers, as AReaL's math reward uses). Module-level and picklable: AReaL's
AsyncRewardWrapper runs it in a process pool."""

from __future__ import annotations

import re
from fractions import Fraction

# DAPO reads only the tail of a solution (its scorer keeps the last 300 characters).
TAIL_CHARS = 300
_ANSWER_RE = re.compile(r"(?i)answer\s*:\s*([^\n]*)")
_SPECIAL_RE = re.compile(r"<\|[^|>]*\|>|</s>|<eos>|<pad>")
_BOXED_RE = re.compile(r"^\\boxed\{(.*)\}$")
_TEXT_RE = re.compile(r"\\text\{([^}]*)\}")
_NUMBER_RE = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)(/\d+)?$")


def extract_answer(text: str) -> str | None:
    """The content of the last 'Answer:' line in the tail of `text`, normalised; None if there is none."""
    tail = _SPECIAL_RE.sub("", text)[-TAIL_CHARS:]
    matches = _ANSWER_RE.findall(tail)
    if not matches:
        return None
    ans = normalize_answer(matches[-1])
    return ans or None


def normalize_answer(ans: str) -> str:
    """Strip the decoration DAPO answers come with: $...$, \\boxed{}, \\text{}, a final period, spaces,
    thousands separators."""
    s = ans.strip().rstrip(".").strip().strip("$").strip()
    m = _BOXED_RE.match(s)
    if m:
        s = m.group(1)
    s = _TEXT_RE.sub(r"\1", s)
    s = s.rstrip(".").strip()
    if re.fullmatch(r"[+-]?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    return s.replace(" ", "")


def _as_number(s: str) -> Fraction | None:
    if not _NUMBER_RE.match(s):
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(pred: str, truth: str) -> bool:
    """Equivalence of a normalised prediction and a ground truth."""
    gold = normalize_answer(str(truth))
    if pred == gold:
        return True
    a, b = _as_number(pred), _as_number(gold)
    if a is not None and b is not None:
        return a == b
    try:  # symbolic answers (fractions in LaTeX, radicals, ...): math-verify, without signal-based timeouts
        from math_verify import LatexExtractionConfig, parse, verify  # (which only work in the main thread)

        cfg = [LatexExtractionConfig()]
        gold_p = parse(f"${gold}$", extraction_config=cfg, parsing_timeout=None)
        pred_p = parse(f"${pred}$", extraction_config=cfg, parsing_timeout=None)
        return bool(gold_p and pred_p and verify(gold_p, pred_p, timeout_seconds=None))
    except Exception:  # noqa: BLE001 - an unparsable answer is a wrong answer, not a crash
        return False


def dapo_math_reward(prompt, completions, prompt_ids, completion_ids, answer, **kwargs) -> float:
    """AReaL reward-function signature: 1.0 when the last 'Answer:' line equals `answer`, else 0.0."""
    pred = extract_answer(str(completions))
    if pred is None:
        return 0.0
    return 1.0 if answers_match(pred, str(answer)) else 0.0
