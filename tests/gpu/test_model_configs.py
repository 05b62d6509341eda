"""Real-model configs (experiments/model/qwen3_*.yaml) and the GPU launch's checks, without a GPU."""

from __future__ import annotations

import pytest

from areal_libra import launch
from areal_libra.config import compose


@pytest.mark.parametrize("model, hf_id, tp", [("qwen3_1_7b", "Qwen/Qwen3-1.7B", 1), ("qwen3_8b", "Qwen/Qwen3-8B", 2),
                                             ("qwen3_14b", "Qwen/Qwen3-14B", 4)])
def test_qwen3_configs_compose_for_a_gpu_node(tmp_path, model, hf_id, tp):
    c = compose(["cluster=gpu", f"model={model}", f"cluster.fileroot={tmp_path}"])
    a = c.areal
    assert a.actor.path == hf_id and a.tokenizer_path == hf_id
    assert a.actor.dtype == "bfloat16" and a.actor.attn_impl == "flash_attention_2"
    assert a.gconfig.max_new_tokens >= 4096 and a.gconfig.max_tokens > a.gconfig.max_new_tokens
    assert a.train_dataset.batch_size >= 32
    assert [g.tp for g in launch.rollout_groups(c)] == [tp] * len(launch.rollout_groups(c))
    p = launch.placement(c, env={}, gpu_count=8)  # fits one 8-GPU node beside the trainer
    assert len(p.trainer) + sum(len(s) for s in p.servers) <= 8
    tiny = compose([f"cluster.fileroot={tmp_path}"])  # the default stays the tiny CPU model
    assert tiny.areal.actor.path == "auto" and tiny.areal.actor.dtype == "float32"


def test_a_hugging_face_id_is_fetched_or_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network here: the id cannot be fetched
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    c = compose(["cluster=gpu", "model=qwen3_8b", f"cluster.fileroot={tmp_path}"])
    with pytest.raises(launch.LaunchError) as err:
        launch.resolve_model(c)
    msg = str(err.value)
    assert "\n" not in msg and "Qwen/Qwen3-8B" in msg and "could not be fetched" in msg
    # A path that is not an id shape is still just a missing directory.
    c.areal.actor.path = str(tmp_path / "nope")
    with pytest.raises(launch.LaunchError, match="no such model directory"):
        launch.resolve_model(c)


def test_torchdynamo_is_disabled_on_cpu_only(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    cpu = launch.trainer_env(compose([f"cluster.fileroot={tmp_path}"]), ["a:1"])
    gpu = launch.trainer_env(compose(["cluster=gpu", f"cluster.fileroot={tmp_path}"]), ["a:1"], ("0",), ("1",))
    assert cpu["TORCHDYNAMO_DISABLE"] == "1" and "TORCHDYNAMO_DISABLE" not in gpu


def test_a_gpu_run_without_sglang_says_what_to_run(tmp_path):
    import importlib.util

    c = compose(["cluster=gpu", f"cluster.fileroot={tmp_path}"])
    if importlib.util.find_spec("sgl_kernel") is not None:
        pytest.skip("a GPU SGLang install is present")
    with pytest.raises(launch.LaunchError) as err:
        launch.check_sglang(c)
    assert "make setup-gpu" in str(err.value) and "\n" not in str(err.value)
    launch.check_sglang(compose([f"cluster.fileroot={tmp_path}"]))  # the CPU cluster needs none
