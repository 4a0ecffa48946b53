"""FSDP2 (``fully_shard``) on CPU under torchrun with gloo: masks on DTensor shards, through a prune and a
densify."""

import json
import os
import subprocess
import sys

import pytest
import torch

from hf_sparsity.storage.masks_file import load_masks

from .conftest import REPO

SCRIPT = REPO / "tests" / "scripts" / "fsdp2_loop.py"


@pytest.mark.slow
def test_fsdp2_plain_loop_masks_match_single_process(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    fsdp_out, single_out = tmp_path / "fsdp", tmp_path / "single"
    fsdp_out.mkdir()
    single_out.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(SCRIPT),
        str(fsdp_out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(single_out)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]

    fsdp = json.loads((fsdp_out / "result_fsdp.json").read_text())
    single = json.loads((single_out / "result_single.json").read_text())
    assert fsdp["world"] == 2 and fsdp["sharded"]  # the engine really worked on DTensor shards
    assert all(n > 0 for n in fsdp["checked_per_step"][:3])  # invariants checked on each rank's shards
    assert fsdp["events"] == single["events"] == ["prune", "densify"]
    assert fsdp["levels"]["1"] == [0.5] and min(fsdp["levels"]["3"]) > 0.799
    assert fsdp["levels"]["5"] == [] and fsdp["masks_after_densify"] == 0
    assert (
        fsdp["densify_zero_ok"] and fsdp["final_nonzero_fraction"] > 0.99
    )  # dense training revived them from 0

    # The consolidated checkpoint after the prune: masks identical to the single-process run's,
    # and the gathered weights really are zero where masked (not "sparsity 0" from stale params).
    fm, _ = load_masks(fsdp_out / "checkpoint-3")
    sm, _ = load_masks(single_out / "checkpoint-3")
    assert fm.keys() == sm.keys() and len(fm) == 14
    for name in fm:
        assert torch.equal(fm[name], sm[name]), name
    from safetensors.torch import load_file

    w = load_file(fsdp_out / "checkpoint-3" / "model.safetensors")
    for name, m in fm.items():
        assert int((m == 0).sum()) == round(0.8 * m.numel())
        assert torch.count_nonzero(w[name][m == 0]) == 0
