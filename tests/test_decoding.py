"""The lean greedy loop (``hf_sparsity.decoding``) gives generate's greedy tokens, dense and sparse."""

from __future__ import annotations

import pytest
import torch

from hf_sparsity.config import SparsityConfig
from hf_sparsity.decoding import greedy_decode
from hf_sparsity.engine import SparsityEngine
from hf_sparsity.inference import sparsify_for_inference
from hf_sparsity.utils import SparsityError

from .conftest import tiny_model


def _generate(model, ids, n):
    with torch.inference_mode():
        return model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=1
        )


@pytest.mark.parametrize("backend", [None, "bitmask"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_lean_loop_is_token_identical_to_generate(arch, backend):
    model = tiny_model(arch).eval()
    if backend:
        eng = SparsityEngine(model, SparsityConfig(sparsity=0.5, init_method="topk"))
        eng.build_masks()
        eng.apply()
        sparsify_for_inference(model, backend, masks=eng.masks)
    for seed in range(3):
        ids = torch.randint(2, 128, (1, 5 + seed), generator=torch.Generator().manual_seed(seed))
        model.generation_config.eos_token_id = None  # run the full length in both
        want = _generate(model, ids, 24)
        seen = []
        got = greedy_decode(model, ids, 24, on_token=seen.append)
        assert torch.equal(got, want)
        assert seen == got[0, ids.shape[1] :].tolist()


def test_lean_loop_stops_at_eos_like_generate():
    model = tiny_model("llama").eval()
    ids = torch.randint(2, 128, (1, 6), generator=torch.Generator().manual_seed(0))
    free = greedy_decode(model, ids, 12, eos_token_id=[])
    eos = int(free[0, ids.shape[1] + 3])  # make the 4th new token the end of sequence
    model.generation_config.eos_token_id = eos
    got = greedy_decode(model, ids, 12)
    want = _generate(model, ids, 12)
    assert int(got[0, -1]) == eos and torch.equal(got, want[:, : got.shape[1]])


def test_lean_loop_refuses_bad_input():
    model = tiny_model("gpt2").eval()
    with pytest.raises(SparsityError, match="one prompt"):
        greedy_decode(model, torch.ones(2, 3, dtype=torch.long), 4)
    with pytest.raises(SparsityError, match="at least 1"):
        greedy_decode(model, torch.ones(1, 3, dtype=torch.long), 0)
