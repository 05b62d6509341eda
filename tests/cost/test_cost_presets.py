"""Presets: built-in names, user YAML, '<hw>x<N>' clusters, and one-line errors."""

import pytest

from areal_libra.cost.presets import PresetError, load_cluster, load_hardware, load_model


def test_builtin_presets_load():
    for name in ("a800", "a100", "h100", "h200", "cpu"):
        assert load_hardware(name).flops > 0
    for name in ("qwen2.5-7b", "qwen3-4b", "qwen3-14b", "qwen3-32b", "qwen3-30b-a3b"):
        assert load_model(name).params > 0
    c = load_cluster("a800x48")
    assert (c.nodes, c.gpus_per_node, c.n_gpus, c.hardware.name) == (6, 8, 48, "a800")
    assert load_cluster("h200x1").n_gpus == 1
    assert load_cluster("h100x16").nodes == 2
    assert load_cluster("cpu").hardware.name == "cpu"


def test_parameter_counts_match_published_sizes():
    # Published sizes: 7.6B, 4.0B, 14.8B, 32.8B, 30.5B total / 3.3B active.
    expect = {"qwen2.5-7b": 7.6e9, "qwen3-4b": 4.0e9, "qwen3-14b": 14.8e9, "qwen3-32b": 32.8e9,
              "qwen3-30b-a3b": 30.5e9}
    for name, n in expect.items():
        assert load_model(name).params == pytest.approx(n, rel=0.03), name
    moe = load_model("qwen3-30b-a3b")
    assert moe.active_params == pytest.approx(3.3e9, rel=0.03)
    # Qwen3-14B by hand: per layer attention 5120*5120*2 + 2*5120*1024 + 2*5120 norms = 62,924,800;
    # MLP 3*5120*17408 = 267,386,880; x40 layers + 2 * 151936*5120 embeddings.
    assert load_model("qwen3-14b").params == 40 * (62_924_800 + 267_386_880) + 2 * 151936 * 5120
    assert load_model("qwen3-14b").kv_bytes_per_token == 163_840  # 40 layers x 8 KV heads x 128 x K,V x bf16


def test_user_yaml(tmp_path):
    hw = tmp_path / "myhw.yaml"
    hw.write_text("flops: 1.0e15\nhbm_bw: 3.0e12\nhbm_bytes: 96.0e9\nintra_bw: 450e9\ninter_bw: 50e9\n")
    h = load_hardware(str(hw))
    assert h.name == "myhw" and h.hbm_bytes == 96e9 and h.gpus_per_node == 8
    cl = tmp_path / "cl.yaml"
    cl.write_text(f"hardware: {hw}\nnodes: 3\ngpus_per_node: 4\n")
    c = load_cluster(str(cl))
    assert c.n_gpus == 12 and c.hardware.flops == 1e15
    m = tmp_path / "m.yaml"
    m.write_text("n_layers: 2\nhidden: 64\nn_heads: 4\nn_kv_heads: 2\nhead_dim: 16\nffn: 128\nvocab: 100\n")
    assert load_model(str(m)).n_layers == 2


@pytest.mark.parametrize(
    "loader,ref,needle",
    [
        (load_hardware, "tpu9", "unknown hardware preset 'tpu9'"),
        (load_model, "llama-9000", "unknown model preset 'llama-9000'"),
        (load_cluster, "a800x0", "zero GPUs"),
        (load_cluster, "a800x12", "do not fill whole"),
        (load_cluster, "nonsense", "unknown cluster"),
        (load_cluster, "/nonexistent/cl.yaml", "no such preset file"),
    ],
)
def test_errors_are_one_line(loader, ref, needle):
    with pytest.raises(PresetError) as e:
        loader(ref)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_malformed_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("flops: [1,\n")
    with pytest.raises(PresetError, match="malformed YAML"):
        load_hardware(str(bad))
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("flops: fast\nhbm_bw: 1\nhbm_bytes: 1\nintra_bw: 1\ninter_bw: 1\n")
    with pytest.raises(PresetError, match="field 'flops' must be float"):
        load_hardware(str(wrong))
    extra = tmp_path / "extra.yaml"
    extra.write_text("n_layers: 2\nhidden: 64\nn_heads: 4\nn_kv_heads: 2\nhead_dim: 16\nffn: 128\nvocab: 9\nfoo: 1\n")
    with pytest.raises(PresetError, match="unknown field 'foo'"):
        load_model(str(extra))
