"""libra.control.cluster=auto: the planner's preset from the machine's GPU model and count (device names as
torch.cuda.get_device_name reports them), the h100x8 preset, and the planner on it."""

from __future__ import annotations

import json

import pytest

from areal_libra.cost.presets import (
    PresetError,
    cluster_for_devices,
    detect_cluster,
    load_cluster,
    resolve_cluster_name,
)

# Real torch.cuda.get_device_name() strings.
H200 = "NVIDIA H200"
H100_SXM = "NVIDIA H100 80GB HBM3"
A100_80 = "NVIDIA A100-SXM4-80GB"
A800_80 = "NVIDIA A800-SXM4-80GB"


@pytest.mark.parametrize("name, count, hardware", [
    (H200, 8, "h200-fitted"), (H200, 1, "h200-fitted"), (H100_SXM, 8, "h100"), (H100_SXM, 4, "h100"),
    (A100_80, 8, "a100"), (A800_80, 2, "a800"),
])
def test_known_gpus_pick_their_preset(name, count, hardware):
    preset = cluster_for_devices([name] * count)
    cluster = load_cluster(preset)  # the name the launcher writes must load
    assert cluster.hardware.name == hardware and cluster.n_gpus == count and cluster.nodes == 1


def test_the_h200_gets_the_fitted_figures():
    fitted = load_cluster(cluster_for_devices([H200] * 8)).hardware
    assert fitted.decode_layer_overhead_s > 0 and fitted.hbm_bytes == 141e9
    assert fitted.hbm_eff != load_cluster("h200x8").hardware.hbm_eff  # not the spec-sheet preset


@pytest.mark.parametrize("names", [["NVIDIA L40S"] * 4, ["NVIDIA H100 PCIe"] * 2, ["NVIDIA A100-PCIE-40GB"],
                                   ["Tesla V100-SXM2-32GB"] * 8, [H100_SXM, H200]])
def test_unknown_or_mixed_gpus_ask_for_a_preset_in_one_line(names):
    with pytest.raises(PresetError) as err:
        cluster_for_devices(names)
    msg = str(err.value)
    assert "\n" not in msg and "set libra.control.cluster" in msg
    assert sorted(set(names))[0] in msg


def test_no_gpu_and_the_embedded_cluster_plan_on_the_cpu_preset():
    assert cluster_for_devices([]) == "cpu"
    assert resolve_cluster_name("auto", device="cpu") == "cpu"  # even on a GPU machine
    assert resolve_cluster_name("a800x48", device="cuda") == "a800x48"  # a name is used as given
    import torch

    if not torch.cuda.is_available():
        assert detect_cluster() == "cpu" and resolve_cluster_name("auto", device="cuda") == "cpu"


def test_h100x8_preset():
    c = load_cluster("h100x8")
    hw = c.hardware
    assert (c.nodes, c.gpus_per_node, c.n_gpus) == (1, 8, 8)
    assert (hw.flops, hw.hbm_bw, hw.hbm_bytes, hw.intra_bw) == (989e12, 3.35e12, 80e9, 900e9)


# Qwen3-1.7B's public config.json (the fields the planner reads). The trainer's planner keeps actor.backend's
# layout (here fsdp:d1); the launch plan that sizes it for Qwen3-8B is tested in tests/gpu/test_dry_run.py.
QWEN3_1_7B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2048,
              "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True,
              "torch_dtype": "bfloat16"}


def test_the_planner_uses_all_eight_h100s_for_qwen3_1_7b(tmp_path):
    from areal_libra.config import compose
    from areal_libra.live.live_cluster import plan_source
    from areal_libra.planner import PlanError

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_1_7B))
    c = compose(["cluster=gpu", "libra.control.cluster=h100x8", "gconfig.max_new_tokens=1024"])
    src = plan_source(c.libra, c.areal, str(tmp_path))
    assert src.cluster.n_gpus == 8
    plan = src.solve([(256, 256 + 1024)] * 64)
    assert plan.train_gpus + plan.rollout_gpus == 8 and plan.idle_gpus == 0
    # The cpu preset (4 GB devices) cannot hold it: what `auto` avoids on a GPU machine.
    c_cpu = compose(["cluster=gpu", "libra.control.cluster=cpu"])
    with pytest.raises(PlanError):
        plan_source(c_cpu.libra, c_cpu.areal, str(tmp_path)).solve([(256, 1280)] * 64)
