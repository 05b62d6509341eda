"""Bad input to the launcher: one clear line naming the problem, non-zero exit, no traceback."""

import subprocess
import sys

import pytest

from areal_libra.config import ConfigError, compose

CASES = [
    (["experiment=no_such_exp"], "unknown experiment 'no_such_exp'"),
    (["no_such_key=1"], "unknown config key 'no_such_key'"),
    (["train_dataset.path=/nonexistent/dapo.parquet"], "train_dataset.path=/nonexistent/dapo.parquet: no such file"),
    (["actor.path={tmp}"], "is not a Hugging Face model"),
]


@pytest.mark.parametrize(("args", "expected"), CASES)
def test_cli_bad_input(args: list[str], expected: str, tmp_path) -> None:
    args = [a.format(tmp=tmp_path) for a in args]
    expected = expected.format(tmp=tmp_path)
    r = subprocess.run([sys.executable, "-m", "areal_libra.launch", *args, f"cluster.fileroot={tmp_path}"],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert "Traceback" not in r.stderr
    assert any(expected in ln for ln in lines), r.stderr
    assert lines[-1].startswith("areal_libra: error:")


def test_overrides_keep_areal_names_and_fall_through_to_libra() -> None:
    c = compose(["total_train_steps=2", "cluster.fileroot=/x", "scheduler.policy=cmlfq", "trial_name=t1"])
    assert c.areal.total_train_steps == 2 and c.areal.cluster.fileroot == "/x"
    assert c.libra.scheduler.policy == "cmlfq"
    assert c.areal.rollout.trial_name == "t1" and str(c.log_dir).endswith("/dapo-math/t1")


@pytest.mark.parametrize("bad", ["actor.optimizer.lr=abc", "libra.nope=1", "cluster=nope", "novalue"])
def test_compose_rejects(bad: str) -> None:
    with pytest.raises(ConfigError):
        compose([bad])
