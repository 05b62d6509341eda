"""experiment=code_sandbox composes onto the dapo_math launcher: its workflow, dataset builder and warm-up
task; the trainer builds its dataset from the config; bad input is one line and exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from areal_libra.config import compose

ROOT = Path(__file__).resolve().parents[2]


def test_composes_with_its_own_workflow_dataset_and_model():
    c = compose(["experiment=code_sandbox", "seed=2"])
    assert c.libra.workflow == "areal_libra.workflows.code_sandbox.CodeSandboxWorkflow"
    assert c.libra.dataset.builder == "areal_libra.workflows.code_data.load_code_dataset"
    assert c.areal.seed == 2 and c.libra.model.task == "code" and c.libra.mode == "libra"
    assert str(c.log_dir).split("/")[-2] == "code-sandbox"
    d = compose([])  # dapo_math keeps its own
    assert d.libra.model.task == "math" and d.libra.dataset.builder.endswith("math_data.load_math_dataset")


def test_trainer_builds_the_configured_dataset():
    from areal_libra.live.train import build_dataset

    c = compose(["experiment=code_sandbox", "libra.dataset.n_problems=5"])
    ds = build_dataset(c.libra, c.areal)
    assert len(ds) == 5 and {"test_inputs", "test_outputs", "example_input"} <= set(ds.column_names)
    assert len(build_dataset(compose(["libra.dataset.n_problems=3"]).libra, c.areal)[0]["answer"]) > 0


def test_unknown_model_task_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "areal_libra.launch", "experiment=code_sandbox", "libra.model.task=chess",
                        f"cluster.fileroot={tmp_path}"], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("areal_libra: error: libra.model.task") and "chess" in lines[-1], r.stderr
