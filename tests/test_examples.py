"""The examples run as shipped (a few steps)."""

import subprocess
import sys

import pytest
import torch

from hf_sparsity.serialization import load_masks

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
