"""The elastic bed on a machine with CUDA (issue 13): CPU replicas never initialise CUDA, so forked bed
processes work; a parent that holds a CUDA context never forks them.

CUDA is made to look present (a CPU build of torch says it is absent), and every way into CUDA
initialisation raises: a CPU step that reaches one fails, as AdamW.step did in forked children."""

from __future__ import annotations

import pytest
import torch

from tests.rigs import elastic_bed as testbed
from tests.rigs.elastic_bed import TestbedConfig, build_replica, run


class CudaTouched(RuntimeError):
    pass


@pytest.fixture
def cuda_present(monkeypatch):
    def touched(*_a, **_k):
        raise CudaTouched("CUDA initialised from the CPU path")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator",
                        lambda check_available=False: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    for mod, name in ((torch.cuda, "_lazy_init"), (torch.cuda, "init"), (torch.cuda, "current_stream"),
                      (torch.cuda, "is_current_stream_capturing"), (torch.accelerator, "current_stream")):
        monkeypatch.setattr(mod, name, touched)


@pytest.mark.parametrize("model", ["mlp", "qwen2"])
def test_cpu_replica_steps_without_touching_cuda(cuda_present, model):
    # What every bed process and the fork server's warm-up do: build a replica, train, update
    # (qwen2: the Hugging Face model of evaluation/elastic_bench.py).
    rep = build_replica(TestbedConfig(model=model, hidden=32, batch_per_rank=2), "core", 0, None)
    for step in range(3):
        rep.compute_gradients(step)
        rep.apply_update()
    assert int(rep.optimizer.state[rep.params[0]]["step"]) == 3


def test_forked_bed_with_cuda_present(cuda_present, monkeypatch, tmp_path):
    # fork: the children inherit the patches, i.e. they see CUDA and fail on any CUDA call, as on a
    # GPU machine whose parent process had initialised CUDA.
    monkeypatch.setenv("ELASTIC_TB_START", "fork")
    res = run(TestbedConfig(max_steps=3, hybrids=()), str(tmp_path))
    assert res["core"][0]["final_step"] == 3


def test_no_fork_from_a_cuda_parent(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert testbed.start_method("fork") == "fork"
    assert testbed.start_method("fork", backend="nccl") == "forkserver"
    assert testbed.start_method("spawn") == "spawn"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert testbed.start_method("fork") == "forkserver"
