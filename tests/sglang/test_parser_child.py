"""The SGLang parsing child (areal_libra/rollout/sglang_args.py) imports sglang.srt.server_args once and serves
every later parse of the process; a child that died is replaced on the next parse, and one that answers nothing
is given up with a clear reason."""

from __future__ import annotations

import importlib.util
import os
import signal

import pytest

from areal_libra.rollout import sglang_args
from areal_libra.rollout.sglang_args import SGLangArgsError, SGLangUnavailable, parse_command_lines

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                reason="sglang is not installed (make setup-sglang installs it --no-deps)")


def _parse(argv: list[str]) -> dict:
    try:
        return parse_command_lines([argv])[0]
    except SGLangUnavailable as e:
        pytest.skip(f"{e}; see requirements/sglang-cpu.txt")


def _pid() -> int:
    proc = sglang_args._CHILD._proc
    assert proc is not None and proc.poll() is None, "no parsing child is running after a parse"
    return proc.pid


def test_one_child_serves_every_parse_and_a_refusal_does_not_end_it():
    assert _parse(["--model-path", "/m", "--tp-size", "2"])["tp_size"] == 2
    pid = _pid()
    with pytest.raises(SGLangArgsError, match="--tp-sizes"):
        parse_command_lines([["--model-path", "/m", "--tp-sizes", "2"]])
    assert _parse(["--model-path", "/m", "--tp-size", "8"])["tp_size"] == 8
    assert _pid() == pid


def test_a_child_that_died_is_replaced_on_the_next_parse():
    _parse(["--model-path", "/m"])
    pid = _pid()
    os.kill(pid, signal.SIGKILL)
    sglang_args._CHILD._proc.wait()
    assert _parse(["--model-path", "/m", "--tp-size", "4"])["tp_size"] == 4
    assert _pid() != pid


def test_a_child_that_answers_nothing_is_given_up_naming_the_wait():
    _parse(["--model-path", "/m"])
    pid = _pid()
    os.kill(pid, signal.SIGSTOP)  # alive, silent
    try:
        with pytest.raises(SGLangUnavailable, match="answered nothing in 1 s"):
            parse_command_lines([["--model-path", "/m"]], timeout=1.0)
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert sglang_args._CHILD._proc is None  # killed; the next parse starts a fresh child
