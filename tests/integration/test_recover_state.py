"""Recover helpers (areal_libra.integration.recover): the recovered step from AReaL's step_info.json, the
metrics kept up to it, the control history saved and reloaded, and the trial's name_resolve cleared.
The end-to-end kill-and-resume run is `python -m evaluation.recover` (minutes)."""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path
from types import SimpleNamespace

from omegaconf import OmegaConf

from areal_libra.integration.recover import (
    clear_name_resolve,
    recovered_steps,
    restore_control_state,
    save_control_state,
    trim_metrics,
)


def _cfg(root: Path, mode: str = "auto"):
    return OmegaConf.create({
        "experiment_name": "exp", "trial_name": "t",
        "recover": {"mode": mode, "fileroot": str(root), "experiment_name": "exp", "trial_name": "t"},
        "cluster": {"name_resolve": {"type": "nfs", "nfs_record_root": str(root / "nr")}},
    })


def test_recovered_steps_reads_aReaL_step_info(tmp_path: Path) -> None:
    import getpass

    cfg = _cfg(tmp_path)
    assert recovered_steps(cfg) is None  # no checkpoint yet
    d = tmp_path / "checkpoints" / getpass.getuser() / "exp" / "t" / "recover_info"
    d.mkdir(parents=True)
    (d / "step_info.json").write_text(json.dumps({"epoch": 0, "epoch_step": 5, "global_step": 5}))
    assert recovered_steps(cfg) == 6
    assert recovered_steps(_cfg(tmp_path, "disabled")) is None  # recover off: a fresh run
    (d / "step_info.json").write_text("{cut")
    assert recovered_steps(cfg) is None


def test_trim_metrics_keeps_steps_up_to_the_checkpoint(tmp_path: Path) -> None:
    p = tmp_path / "metrics.jsonl"
    p.write_text("".join(json.dumps({"step": s, "reward": s / 10}) + "\n" for s in range(1, 9)) + '{"step": 9, "rew')
    assert trim_metrics(p, 6) == 6
    assert [json.loads(x)["step"] for x in p.read_text().splitlines()] == [1, 2, 3, 4, 5, 6]
    assert trim_metrics(tmp_path / "none.jsonl", 3) == 0


def test_control_history_roundtrip(tmp_path: Path) -> None:
    a = SimpleNamespace(finished=deque([(10, 40), (12, 90)], maxlen=2000))
    save_control_state(tmp_path, 7, a)
    b = SimpleNamespace(finished=deque(maxlen=2000))
    assert restore_control_state(tmp_path, b) == 2
    assert list(b.finished) == [(10, 40), (12, 90)]
    (tmp_path / "control_state.json").write_text("not json")
    assert restore_control_state(tmp_path, b) == 0  # unreadable: nothing restored, no crash


def test_clear_name_resolve_removes_the_trials_records(tmp_path: Path) -> None:
    from areal.utils import name_resolve, names

    cfg = _cfg(tmp_path)
    name_resolve.reconfigure(cfg.cluster.name_resolve)
    # records a SIGKILLed trainer leaves on disk (it never ran its exit clean-up)
    key = names.update_weights_from_disk("exp", "t", 0)
    name_resolve.add(key, "1", delete_on_exit=False)
    other = names.update_weights_from_disk("exp", "other", 0)
    name_resolve.add(other, "1", delete_on_exit=False)
    clear_name_resolve(cfg)
    name_resolve.add(key, "2")  # would raise NameEntryExistsError had the stale record stayed
    assert name_resolve.get(other) == "1"  # another trial's records are left alone
