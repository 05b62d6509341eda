"""One description of the small Qwen2 shape (models/shape.py): every builder takes its sizes from it."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import pytest

from areal_libra.models.shape import TINY_QWEN2, Qwen2Shape

SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "max_position_embeddings", "tie_word_embeddings")


def _shape_of(config) -> dict:
    return {k: getattr(config, k) for k in SHAPE_KEYS}


def _expected(shape: Qwen2Shape) -> dict:
    return {k: v for k, v in asdict(shape).items() if k in SHAPE_KEYS}


def test_random_tiny_model_is_built_at_its_shape(tmp_path):
    from transformers import AutoConfig

    from areal_libra.models.random_tiny import RANDOM_TINY_SHAPE, TinyModelSpec, build_char_tokenizer, build_tiny_model

    odd = replace(RANDOM_TINY_SHAPE, hidden_size=48, num_hidden_layers=3)
    for shape in (RANDOM_TINY_SHAPE, odd):
        out = build_tiny_model(str(tmp_path / f"m{shape.hidden_size}"), TinyModelSpec(shape=shape))
        cfg = AutoConfig.from_pretrained(out)
        assert _shape_of(cfg) == _expected(shape)
        assert cfg.vocab_size == len(build_char_tokenizer())  # the tokenizer's vocabulary, not the shape's


def test_profile_model_and_cost_spec_follow_the_shape():
    from areal_libra.cost.profile import build_model, profile_shape

    shape = profile_shape(128, 2)
    model, spec = build_model(shape, "cpu")
    assert _shape_of(model.config) == _expected(shape) and model.config.vocab_size == shape.vocab_size
    assert (spec.hidden, spec.n_layers, spec.n_heads, spec.n_kv_heads, spec.ffn, spec.vocab, spec.head_dim) == (
        128, 2, 2, 1, 512, shape.vocab_size, 64)
    layer = model.model.layers[0]
    assert layer.self_attn.k_proj.out_features == spec.n_kv_heads * spec.head_dim
    assert layer.mlp.up_proj.out_features == spec.ffn


def test_policy_config_carries_the_shape(tmp_path):
    from areal_libra.models.tiny import TinyModelConfig, model_dir

    assert TinyModelConfig().shape == TINY_QWEN2 and TinyModelConfig.for_task("code").shape == TINY_QWEN2
    wider = TinyModelConfig(shape=replace(TINY_QWEN2, hidden_size=256))
    assert model_dir(tmp_path, 0, wider) != model_dir(tmp_path, 0)  # the shape is part of the cache key
    untied = TinyModelConfig(shape=replace(TINY_QWEN2, tie_word_embeddings=False))
    assert model_dir(tmp_path, 0, untied) != model_dir(tmp_path, 0)


def test_bad_shapes_are_one_clear_error():
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        Qwen2Shape(num_attention_heads=5, num_key_value_heads=2)
    with pytest.raises(ValueError, match=">= 1"):
        Qwen2Shape(num_hidden_layers=0)


def test_profile_cli_rejects_an_impossible_shape():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "areal_libra.cost.profile", "--quick", "--hidden", "320"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "num_key_value_heads" in r.stderr


def test_built_policy_matches_its_shape(tmp_path):
    from areal_libra.models.tiny import TinyModelConfig, ensure_model
    from areal_libra.models.warmup import WarmupConfig

    shape = Qwen2Shape(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, vocab_size=300)
    cfg = TinyModelConfig(name="shape-test", shape=shape, tokenizer_corpus_problems=100,
                          warmup=WarmupConfig(steps=1, batch_size=2), probe_episodes=0)
    out = ensure_model(cache_dir=tmp_path, config=cfg, quiet=True)
    saved = json.loads((out / "config.json").read_text())
    assert {k: saved[k] for k in SHAPE_KEYS} == _expected(shape)
    assert saved["vocab_size"] % 64 == 0 and saved["vocab_size"] >= 300  # the BPE target, rounded up
