"""The SPDF recipe under ``accelerate launch`` on two processes (DDP on CPU, gloo): sparse and dense
pre-training, both runs in one launch (a module fixture: the suite's scheduler keeps the file on one
worker)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO
from .test_recipes import SMALL

DDP_SPARSITY = (0.75, 0.0)  # 0: fine-tuning loads pretrain/final, nothing between


@pytest.fixture(scope="module")
def spdf_under_ddp(tmp_path_factory):
    """The SPDF recipe at 0.75 and at 0 (fine-tuning loads pretrain/final, nothing between) under
    ``accelerate launch`` on two processes (DDP, gloo): both runs in one launch, one after the other
    (``tests/scripts/recipe_runs.py``), each into its own folder."""
    root = tmp_path_factory.mktemp("spdf_ddp")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", "0", str(REPO / "tests" / "scripts" / "recipe_runs.py"), "spdf",
    ]  # fmt: skip
    for i, sparsity in enumerate(DDP_SPARSITY):
        cmd += ["--then"] if i else []
        cmd += ["--output_dir", str(root / str(sparsity)), *SMALL, "--pretrain_steps", "4",
                "--finetune_steps", "2", "--sparsity", str(sparsity)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root


@pytest.mark.slow
@pytest.mark.parametrize("sparsity", DDP_SPARSITY)
def test_spdf_recipe_under_accelerate_ddp(sparsity, spdf_under_ddp):
    out = spdf_under_ddp / str(sparsity)
    res = json.loads((out / "results.json").read_text())
    assert res["pretrain_sparsity"] == pytest.approx(sparsity, abs=1e-3)
    # 2 processes x 4 samples per step: the FLOP counter saw both ranks' tokens.
    assert res["stages"][0]["flops"]["tokens"] == 4 * 2 * 4 * 64
    assert res["stages"][1]["steps"] == 2 and res["finetune_eval_loss"] > 0
    masks = list(Path(out, "pretrain").glob("checkpoint-*/sparsity_masks.safetensors"))
    assert bool(masks) == (sparsity > 0)
