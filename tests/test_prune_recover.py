"""recipes/prune_recover.py end to end with tiny settings: stages, masks kept, outputs."""

import importlib.util
import json
import sys

import pytest
import torch
from safetensors.torch import load_file

from .conftest import REPO

TINY = [
    "--max_texts", 300, "--eval_blocks", 8, "--block_size", 32, "--dense_steps", 30, "--recover_steps", 6,
    "--nsamples", 4, "--seqlen", 32, "--batch_size", 4, "--hidden_size", 32, "--method", "sparsegpt",
    "--sparsity", 0.6, "--distill_alpha", 0.5,
]  # fmt: skip


@pytest.mark.slow
def test_prune_recover_recipe(tmp_path):
    sys.path.insert(0, str(REPO / "recipes"))  # as when run as a script: its folder first (_common)
    spec = importlib.util.spec_from_file_location("prune_recover", REPO / "recipes" / "prune_recover.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    res = recipe.main(["--output_dir", str(tmp_path), *map(str, TINY)])
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [s["stage"] for s in saved["stages"]] == ["dense", "pruned", "recovered", "final"]
    assert saved["gap_closed"] == res["gap_closed"]
    dense, pruned, recovered, final = saved["stages"]
    assert dense["zero_fraction_of_matrices"] == 0
    assert pruned["heldout_ppl"] > dense["heldout_ppl"]  # pruning a trained model costs something
    assert recovered["masks_restored_from"] == str(tmp_path / "pruned")
    assert recovered["zero_fraction_of_matrices"] == pytest.approx(pruned["zero_fraction_of_matrices"])
    # FLOP accounting counts the tokens actually trained: steps x batch x block_size
    assert recovered["recover_tokens"] == 6 * 4 * 32
    assert 0 < recovered["recover_training_flops"]
    assert final["heldout_ppl"] == pytest.approx(recovered["heldout_ppl"], rel=1e-5)
    # The recovered weights are zero exactly where the one-shot masks are.
    from hf_sparsity.storage.masks_file import load_masks

    masks, _ = load_masks(tmp_path / "pruned")
    weights = load_file(tmp_path / "recovered" / "model.safetensors")
    for name, mask in masks.items():
        assert torch.all(weights[name][mask == 0] == 0) and torch.count_nonzero(weights[name]) > 0
    assert not (tmp_path / "final" / "sparsity_masks.safetensors").exists()
    assert (tmp_path / "perplexity.png").stat().st_size > 1000
