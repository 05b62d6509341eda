"""The tiny Qwen2 model + tokenizer builder: build, cache, load, warm-up, CLI."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from areal_libra.models.shape import Qwen2Shape
from areal_libra.models.tiny import BUILD_INFO, TinyModelConfig, ensure_model, is_complete, model_dir
from areal_libra.models.warmup import WarmupConfig, corrupt_number, demonstration, supervised_warmup
from areal_libra.workflows.markup import CALC_CLOSE, CALC_OPEN, TOOL_TOKENS
from areal_libra.workflows.math_data import generate_problems

# A very small configuration so that the build takes a few seconds; the recipe is the default one.
SMALL = TinyModelConfig(
    name="test-tiny",
    shape=Qwen2Shape(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1),
    tokenizer_corpus_problems=200,
    warmup=WarmupConfig(steps=4, batch_size=8),
    probe_episodes=4,
)


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def built(cache_root):
    return ensure_model(cache_dir=cache_root, seed=0, config=SMALL, quiet=True)


def test_build_layout_and_cache_hit(built, cache_root):
    assert built == model_dir(cache_root, 0, SMALL) and is_complete(built)
    names = {p.name for p in built.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", BUILD_INFO} <= names
    assert not [p for p in built.parent.iterdir() if p.name.startswith(".")], "temporary build dir left behind"
    info = json.loads((built / BUILD_INFO).read_text())
    assert info["parameters"] > 0 and info["probe"]["episodes"] == 4
    stamp = (built / BUILD_INFO).stat().st_mtime_ns
    assert ensure_model(cache_dir=cache_root, seed=0, config=SMALL, quiet=True) == built
    assert (built / BUILD_INFO).stat().st_mtime_ns == stamp  # cache hit: nothing rebuilt
    assert model_dir(cache_root, 1, SMALL) != built  # the seed is part of the key


def test_incomplete_build_is_rebuilt(cache_root, tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "config.json").write_text("{}")  # debris of an interrupted build: no build_info.json
    assert not is_complete(out)
    assert ensure_model(out=out, config=SMALL, quiet=True) == out and is_complete(out)
    stamp = (out / BUILD_INFO).stat().st_mtime_ns
    ensure_model(out=out, config=SMALL, quiet=True, force=True)
    assert (out / BUILD_INFO).stat().st_mtime_ns != stamp


def test_orphaned_temp_dirs_of_killed_builders_are_removed(tmp_path):
    out = tmp_path / "models" / "m"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = out.parent / f".m.{dead.pid}.abc123"
    live = out.parent / f".m.{os.getpid()}.def456"  # a builder still running keeps its dir
    orphan.mkdir(parents=True)
    live.mkdir()
    ensure_model(out=out, config=SMALL, quiet=True)
    assert not orphan.exists() and live.exists() and is_complete(out)


def test_loads_with_transformers_and_areal(built):
    import torch
    from areal.utils.hf_utils import load_hf_tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    cfg = AutoConfig.from_pretrained(built)
    assert cfg.model_type == "qwen2" and cfg.architectures == ["Qwen2ForCausalLM"]
    model = AutoModelForCausalLM.from_pretrained(built, dtype=torch.float32, attn_implementation="sdpa")
    assert next(model.parameters()).dtype == torch.float32
    for tok in (AutoTokenizer.from_pretrained(built), load_hf_tokenizer(str(built))):
        assert tok.eos_token_id is not None and tok.pad_token_id is not None
        assert tok.eos_token_id != tok.pad_token_id
        assert len(tok) <= cfg.vocab_size
    ids = tok.encode("What is 3+4?", add_special_tokens=False)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), cfg.vocab_size) and torch.isfinite(logits).all()


def test_tokenizer_round_trip_and_tool_tokens(built):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built)
    for text in ["What is (12+7)*3?", "héllo wörld ∑ 1,234\n\tx  ", "Answer: $\\frac{1}{2}$", "<calc>1+1</calc>x"]:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    for tag in TOOL_TOKENS:
        ids = tok.encode(tag, add_special_tokens=False)
        assert len(ids) == 1 and tok.decode(ids, skip_special_tokens=True) == tag  # not stripped as special
    digits = tok.encode("12345", add_special_tokens=False)
    assert len(digits) == 5  # one token per digit keeps arithmetic learnable
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == "S\nU\n"


def test_demonstrations_are_imperfect_in_the_configured_shares():
    cfg = WarmupConfig(tool_fraction=0.5, corrupt_fraction=0.3)
    rng = random.Random(0)
    probs = generate_problems(2000, seed=7)
    tool = corrupted = 0
    for p in probs:
        demo = demonstration(p, rng, cfg)
        if demo[0][0].startswith(CALC_OPEN):
            tool += 1
            assert demo[0][0] == f"{CALC_OPEN}{p.expression}{CALC_CLOSE}" and demo[1][1] is False
            corrupted += demo[2][0] != f"\nAnswer: {p.answer}"
        else:
            assert demo == [(f"Answer: {p.answer}", True)]
    assert 0.45 < tool / len(probs) < 0.55
    assert 0.25 < corrupted / tool < 0.35
    for s in ["0", "7", "10", "449", "1000", "98765"]:
        for i in range(50):
            c = corrupt_number(s, random.Random(i))
            assert c != s and c.isdigit()


def test_warmup_reduces_loss():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from areal_libra.models.tiny import _tokenizer_corpus
    from areal_libra.models.tokenizer import build_tokenizer

    tok = build_tokenizer(_tokenizer_corpus(200), 512)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg)
    losses = supervised_warmup(model, tok, WarmupConfig(steps=30, batch_size=8, lr=3e-3))
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5


def test_cli_rejects_a_file_as_output(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    r = subprocess.run([sys.executable, "-m", "areal_libra.models.tiny", "--out", str(f)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and str(f) in r.stderr and "Traceback" not in r.stderr


def test_cache_key_carries_the_recipe_version_and_the_warmup(tmp_path):
    from dataclasses import replace

    from areal_libra.models.tiny import FORMAT_VERSION

    base = TinyModelConfig()
    name = model_dir(tmp_path, 1, base).name
    assert name.startswith(f"tiny-qwen2-math-v{FORMAT_VERSION}-")
    for changed in (replace(base, warmup=replace(base.warmup, steps=base.warmup.steps + 1)),
                    replace(base, warmup=replace(base.warmup, clean_share=0.0 if base.warmup.clean_share else 0.5)),
                    replace(base, probe_episodes=base.probe_episodes + 1)):
        assert model_dir(tmp_path, 1, changed).name != name  # a stale build is never reused
    keys = {model_dir(tmp_path, 1, TinyModelConfig.for_task(t)).name for t in ("math", "code", "search_r1")}
    assert len(keys) == 3


def test_threads_follow_the_load(monkeypatch):
    from areal_libra.models import warmup

    monkeypatch.setattr(warmup.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(warmup.os, "getloadavg", lambda: (0.2, 0.0, 0.0))
    assert warmup.fit_threads() == 2  # an idle 2-core machine: both cores
    monkeypatch.setattr(warmup.os, "getloadavg", lambda: (2.1, 0.0, 0.0))
    assert warmup.fit_threads(own=2) == 2  # the load is our own two threads
    assert warmup.fit_threads(own=0) == 1  # someone else keeps the cores busy: one thread, no spinning
    monkeypatch.setattr(warmup.os, "getloadavg", lambda: (20.0, 0.0, 0.0))
    assert warmup.fit_threads(own=2) == 1


def test_clean_share_starts_on_clean_demonstrations():
    from areal_libra.models.warmup import demo_config

    cfg = WarmupConfig(steps=10, clean_share=0.3, tool_fraction=0.75, corrupt_fraction=0.2)
    used = [demo_config(cfg, s) for s in range(10)]
    assert all(c.tool_fraction == 1.0 and c.corrupt_fraction == 0.0 for c in used[:3])
    assert all(c == cfg for c in used[3:])
    rng = random.Random(0)
    probs = generate_problems(200, seed=3)
    demos = [demonstration(p, rng, used[0]) for p in probs]
    assert all(d[0][0] == f"{CALC_OPEN}{p.expression}{CALC_CLOSE}" and d[2][0] == f"\nAnswer: {p.answer}"
               for d, p in zip(demos, probs))
