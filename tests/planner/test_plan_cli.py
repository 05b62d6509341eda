"""python -m areal_libra.plan: JSON keys, explain output, and one-line errors for bad input."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from areal_libra.plan import main

ROOT = Path(__file__).resolve().parents[2]
SEARCH_R1 = "/work/shared/data/polytrace/search_r1/step_0.jsonl.gz"


@pytest.fixture
def lengths(tmp_path):
    p = tmp_path / "lengths.txt"
    p.write_text("# prompt,final\n" + "".join(f"{100 + i},{600 + 37 * i}\n" for i in range(200)))
    return str(p)


def test_json_output(lengths, capsys):
    assert main(["--cluster", "a800x16", "--model", "qwen3-4b", "--lengths", lengths, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"train", "rollout", "t_train_s", "t_rollout_s", "makespan_s", "solve_s"}
    assert set(out["train"]) == {"gpus", "tp", "pp", "dp", "ep", "micro_batch", "backend"}
    assert out["train"]["backend"] == "megatron" and out["rollout"]["backend"] == "sglang"
    assert all(set(i) == {"tp", "count"} for i in out["rollout"]["instances"])
    assert out["train"]["gpus"] + out["rollout"]["gpus"] == 16
    assert out["makespan_s"] == max(out["t_train_s"], out["t_rollout_s"])


def test_explain_and_allowed_tp(lengths, capsys):
    assert main(["--cluster", "a800x16", "--model", "qwen3-14b", "--lengths", lengths, "--explain",
                 "--allowed-tp", "2,4"]) == 0
    out = capsys.readouterr().out
    assert "training decision tree" in out and "level" in out and "rollout DP interval assignment" in out
    assert "t1" not in out.split("rollout:")[1].split("\n")[0]  # no TP1 servers when only 2,4 are allowed


def test_trace_input_polytrace(capsys):
    assert main(["--cluster", "a800x48", "--model", "qwen3-14b", "--trace", SEARCH_R1, "--json",
                 "--global-batch", "2048"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["train"]["gpus"] + out["rollout"]["gpus"] == 48


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--cluster", "a800x48", "--model", "nope"], "unknown model preset 'nope'"),
        (["--cluster", "b9000x8", "--model", "qwen3-4b"], "unknown hardware preset 'b9000'"),
        (["--cluster", "a800x0", "--model", "qwen3-4b"], "zero GPUs"),
        (["--cluster", "a800x1", "--model", "qwen3-4b"], "at least 1 training and 1 rollout GPU"),
        (["--cluster", "a800x16", "--model", "qwen3-4b", "--allowed-tp", "1,16"], "larger than a node"),
        (["--cluster", "a800x16", "--model", "qwen3-4b", "--allowed-tp", "x"], "--allowed-tp"),
        (["--cluster", "a800x8", "--model", "qwen3-32b"], "memory"),
    ],
)
def test_bad_input_one_line(args, needle, lengths, capsys):
    assert main(args + ["--lengths", lengths]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err


def test_malformed_files(tmp_path, lengths, capsys):
    bad_yaml = tmp_path / "c.yaml"
    bad_yaml.write_text("hardware: [a800\n")
    bad_lengths = tmp_path / "l.txt"
    bad_lengths.write_text("10,20\n30\n")
    bad_trace = tmp_path / "t.jsonl"
    bad_trace.write_text('{"trajectory_id": "a", "prompt_id": "p", "step": 0, "prompt_tokens": 5, "segments": []}\n')
    cases = [
        (["--cluster", str(bad_yaml), "--model", "qwen3-4b", "--lengths", lengths], "malformed YAML"),
        (["--cluster", "a800x8", "--model", "qwen3-4b", "--lengths", str(bad_lengths)], "l.txt:2"),
        (["--cluster", "a800x8", "--model", "qwen3-4b", "--trace", str(bad_trace)], "t.jsonl:1"),
        (["--cluster", "a800x8", "--model", "qwen3-4b", "--trace", str(tmp_path / "none.jsonl")], "no such"),
        (["--cluster", "a800x8", "--model", "qwen3-4b"], "required"),
    ]
    for args, needle in cases:
        assert main(args) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, (args, err)


def test_module_entry_point_exit_status(lengths):
    ok = subprocess.run([sys.executable, "-m", "areal_libra.plan", "--cluster", "a800x8", "--model", "qwen3-4b",
                         "--lengths", lengths, "--json"], capture_output=True, text=True, cwd=ROOT)
    assert ok.returncode == 0 and json.loads(ok.stdout)["train"]["gpus"] >= 1
    bad = subprocess.run([sys.executable, "-m", "areal_libra.plan", "--cluster", "a800x8", "--model", "x",
                          "--lengths", lengths], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode != 0 and bad.stderr.strip().startswith("error:") and "Traceback" not in bad.stderr
