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


def _recipe():
    sys.path.insert(0, str(REPO / "recipes"))  # as when run as a script: its folder first (_common)
    spec = importlib.util.spec_from_file_location("prune_recover", REPO / "recipes" / "prune_recover.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    return recipe


@pytest.mark.slow
def test_prune_recover_recipe(tmp_path):
    recipe = _recipe()
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
    weights = recovered_w = load_file(tmp_path / "recovered" / "model.safetensors")
    for name, mask in masks.items():
        assert torch.all(weights[name][mask == 0] == 0) and torch.count_nonzero(weights[name]) > 0
    assert not (tmp_path / "final" / "sparsity_masks.safetensors").exists()
    assert (tmp_path / "perplexity.png").stat().st_size > 1000

    # --pruned: the folder just pruned, recovered again as it is (no pruning here): the same masks and the
    # same pruned perplexity on the same held-out blocks (the dense folder's tokenizer reads the same text)
    again = tmp_path / "again"
    args = ["--model", str(tmp_path / "dense"), "--pruned", str(tmp_path / "pruned"), "--dense_steps", "0"]
    recipe.main(["--output_dir", str(again), *map(str, TINY), *args, "--sparsity", "0.3"])  # folder wins
    stages = json.loads((again / "results.json").read_text())["stages"]
    assert [s["stage"] for s in stages] == ["dense", "pruned", "recovered", "final"]
    assert stages[0]["heldout_ppl"] == pytest.approx(dense["heldout_ppl"], rel=1e-5)
    assert stages[1]["heldout_ppl"] == pytest.approx(pruned["heldout_ppl"], rel=1e-5)
    assert stages[1]["pruned_from"] == str(tmp_path / "pruned") and "prune_s" not in stages[1]
    assert stages[2]["masks_restored_from"] == str(again / "pruned")
    assert stages[2]["zero_fraction_of_matrices"] == pytest.approx(pruned["zero_fraction_of_matrices"])
    # the same start, data and seed: the same recovered weights as pruning in the recipe gave
    weights = load_file(again / "recovered" / "model.safetensors")
    assert weights.keys() == recovered_w.keys()
    for name in weights:
        torch.testing.assert_close(weights[name], recovered_w[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["tiny model", "no masks", "other shapes"])
def test_pruned_folder_refusals_write_nothing(tmp_path, case):
    from hf_sparsity import SparsityError

    from .conftest import tiny_model

    recipe = _recipe()
    dense, other = tmp_path / "dense", tmp_path / "other"
    tiny_model("llama").save_pretrained(dense)
    tiny_model("llama", hidden=16).save_pretrained(other)
    args = ["--model", str(dense), "--pruned", str(other)]
    if case == "tiny model":
        args = ["--pruned", str(other)]
    if case == "other shapes":
        from hf_sparsity.storage.masks_file import save_masks

        save_masks(other, {"model.layers.0.mlp.up_proj.weight": torch.ones(32, 16, dtype=torch.uint8)})
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    match = {"tiny model": "needs --model", "no masks": "no sparsity_masks", "other shapes": "shapes"}[case]
    with pytest.raises(SparsityError, match=match):
        recipe.main(["--output_dir", str(out), "--overwrite", "true", *args])
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


@pytest.mark.slow
def test_bf16_recovery_runs_under_autocast_and_keeps_float32_weights_and_masks(tmp_path, monkeypatch):
    """--bf16 true: the student's and the teacher's forwards run under bf16 autocast, the loss is finite, the
    evaluations after training in float32; the weights the recipe saves stay float32, zero where the masks
    are, and trained elsewhere."""
    recipe = _recipe()
    seen = []
    original = recipe.DistillTrainer.compute_loss

    def spy(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not seen:  # hooks on both models' LM heads: the autocast state as their products run
            for who, m in (("student", model), ("teacher", self.teacher)):
                m.get_output_embeddings().register_forward_pre_hook(
                    lambda mod, a, who=who: seen.append(
                        (who, torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
                    )
                )
        loss = original(self, model, inputs, return_outputs, num_items_in_batch)
        assert torch.isfinite(loss if not return_outputs else loss[0])
        return loss

    monkeypatch.setattr(recipe.DistillTrainer, "compute_loss", spy)
    recipe.main(["--output_dir", str(tmp_path), *map(str, TINY), "--bf16", "true", "--recover_steps", "11"])
    # every recovery step: one student and one teacher forward, both in bf16; then the recovered stage's
    # held-out evaluation (8 blocks, batches of 4) on the student's own forward, in float32
    assert seen[:22] == [("student", True, torch.bfloat16), ("teacher", True, torch.bfloat16)] * 11
    assert [(who, on) for who, on, _ in seen[22:]] == [("student", False)] * 2
    from hf_sparsity.storage.masks_file import load_masks

    masks, _ = load_masks(tmp_path / "pruned")
    weights = load_file(tmp_path / "recovered" / "model.safetensors")
    pruned = load_file(tmp_path / "pruned" / "model.safetensors")
    assert all(w.dtype == torch.float32 for w in weights.values())
    for name, mask in masks.items():
        assert torch.all(weights[name][mask == 0] == 0)
        assert not torch.equal(weights[name], pruned[name])  # the kept weights were trained
