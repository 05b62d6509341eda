"""Patch 16 on the installed AReaL: the disk weight update, which runs while every rollout server is paused,
sees the trainer's save within a fine poll instead of AReaL's 1-second name-resolve poll."""

import threading
import time
from datetime import datetime

from areal.api.cli_args import NameResolveConfig
from areal.api.io_struct import WeightUpdateMeta
from areal.engine.sglang_remote import SGLangBackend
from areal.infra.remote_inf_engine import _update_weights_from_disk
from areal.utils import name_resolve, names


def test_disk_update_follows_the_save_within_a_fine_poll(tmp_path) -> None:
    name_resolve.reconfigure(NameResolveConfig(type="nfs", nfs_record_root=str(tmp_path / "names")))
    name = names.update_weights_from_disk("exp", "trial", 3)
    save_s = 0.3

    def save() -> None:  # the trainer: writes the weights, then publishes the name
        time.sleep(save_s)
        name_resolve.add(name, str(datetime.now().timestamp()), replace=True)

    saver = threading.Thread(target=save)
    t0 = time.perf_counter()
    saver.start()
    _update_weights_from_disk(SGLangBackend(), "exp", "trial", 3, [],
                              WeightUpdateMeta(type="disk", path=str(tmp_path / "w")), 1, 10.0)
    waited = time.perf_counter() - t0
    saver.join()
    # Unpatched, the first poll misses the save and the next comes a second later (>= 1.0 s in all).
    assert save_s <= waited < 0.8, waited
