"""Patch 06: AReaL packs micro-batches into one row; with sdpa on CPU each sequence must still attend
only to itself (before the patch the causal mask ran across the packed sequences)."""

import os
import socket

import pytest
import torch
from areal_libra.utils import free_port

pytestmark = pytest.mark.slow


def test_fsdp_forward_on_packed_batch_matches_per_sequence_hf(tmp_path) -> None:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()), TORCHDYNAMO_DISABLE="1")
    from areal.api.cli_args import MicroBatchSpec, OptimizerConfig, TrainEngineConfig
    from areal.api.io_struct import FinetuneSpec
    from areal.engine.fsdp_engine import FSDPEngine
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    qc = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    ref = Qwen2ForCausalLM(qc).eval()
    ref.save_pretrained(str(tmp_path / "model"))
    cfg = TrainEngineConfig(backend="fsdp:d1", path=str(tmp_path / "model"), dtype="float32", attn_impl="sdpa",
                            disable_dropout=True, mb_spec=MicroBatchSpec(max_tokens_per_mb=4096),
                            optimizer=OptimizerConfig(type="adam", lr=0.0, lr_scheduler_type="constant",
                                                      warmup_steps_proportion=0.0))
    engine = FSDPEngine(cfg)
    engine.create_process_group()
    engine.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=8, train_batch_size=3))
    try:
        lens = [5, 11, 8]
        seqs = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)) for n in lens]
        width = max(lens)
        ids = torch.stack([torch.cat([s, torch.zeros(width - len(s), dtype=torch.long)]) for s in seqs])
        mask = torch.tensor([[1] * n + [0] * (width - n) for n in lens])
        out = engine.forward_batch(dict(input_ids=ids, attention_mask=mask))
        assert out.shape[0] == len(lens)
        # The engine returns the log-probability of each next token (temperature 1).
        for i, s in enumerate(seqs):
            with torch.no_grad():
                logp = torch.log_softmax(ref(input_ids=s[None]).logits[0].float(), -1)
            want = logp[:-1].gather(-1, s[1:, None])[:, 0]
            got = out[i, : len(s) - 1]
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    finally:
        engine.destroy()
