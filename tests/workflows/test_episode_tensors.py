"""The one builder of AReaL's per-episode trajectory dict (shared by the real and the emulated workflows)."""

import pytest
import torch

from areal_libra.workflows.tensors import episode_tensors


def test_columns_get_a_batch_dimension_and_areal_dtypes():
    res = episode_tensors([5, 6, 7], [0, 1, 1], [0.0, -0.5, -1.0], [-1, 3, 3], 0.25,
                          emul_tokens=torch.tensor(900, dtype=torch.int64))
    assert res["input_ids"].tolist() == [[5, 6, 7]] and res["input_ids"].dtype == torch.int32
    assert res["loss_mask"].tolist() == [[0, 1, 1]] and res["versions"].tolist() == [[-1, 3, 3]]
    assert res["logprobs"].dtype == torch.float32 and res["attention_mask"].dtype == torch.bool
    assert res["attention_mask"].tolist() == [[True] * 3]
    assert res["rewards"].shape == (1,) and res["rewards"].item() == 0.25
    assert res["emul_tokens"].tolist() == [900]


def test_columns_of_different_lengths_are_refused():
    with pytest.raises(ValueError, match="seq 3, loss_mask 2"):
        episode_tensors([5, 6, 7], [0, 1], [0.0, 0.0, 0.0], [-1, 0, 0], 1.0)


def test_an_episode_masks_context_and_keeps_the_servers_logprobs_and_versions():
    from types import SimpleNamespace

    from areal_libra.workflows.tensors import Episode

    ep = Episode()
    ep.add_context([1, 2])
    out = ep.add_output(SimpleNamespace(output_tokens=[7, 8], output_logprobs=[-0.1, -0.2], output_versions=[4, 5]))
    ep.add_context([9])
    assert out == [7, 8]
    res = ep.tensors(1.0)
    assert res["input_ids"].tolist() == [[1, 2, 7, 8, 9]] and res["loss_mask"].tolist() == [[0, 0, 1, 1, 0]]
    assert res["versions"].tolist() == [[-1, -1, 4, 5, -1]]
    assert res["logprobs"][0].tolist() == pytest.approx([0.0, 0.0, -0.1, -0.2, 0.0])
