"""The examples run as shipped (a few steps)."""

import os
import subprocess
import sys

import pytest
import torch

from hf_sparsity.storage.masks_file import load_masks

from .conftest import REPO


@pytest.mark.slow
def test_accelerate_loop_example(tmp_path):
    out = tmp_path / "model"
    cmd = [
        sys.executable,
        str(REPO / "examples" / "accelerate_loop.py"),
        "--steps",
        "4",
        "--output_dir",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "level 0.7500" in proc.stdout
    masks, _ = load_masks(out)
    from safetensors.torch import load_file

    weights = load_file(out / "model.safetensors")
    for name, m in masks.items():
        assert int((m == 0).sum()) == round(0.75 * m.numel())
        assert torch.count_nonzero(weights[name][m == 0]) == 0


@pytest.mark.slow
def test_lora_sparse_example_runs(tmp_path):
    """examples/lora_sparse.py end to end: merged weights exactly sparse, finalized folder with a card."""
    pytest.importorskip("peft")
    import yaml

    from hf_sparsity.storage.folders import inspect_checkpoint

    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "lora_sparse.py"), "--out", str(tmp_path), "--steps", "6"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "merged: 60.00% of the" in proc.stdout
    final = tmp_path / "final"
    card = (final / "README.md").read_text()
    assert "sparse" in yaml.safe_load(card.split("---")[1])["tags"]
    assert "| optimizer steps trained with masks | 6 |" in card and "| lora | `masked` |" in card
    rows = [r for r in inspect_checkpoint(final)["layers"] if r["name"].endswith("proj.weight")]
    assert rows and all(abs(r["zero_fraction"] - 0.6) < 0.01 for r in rows)
