"""DDP through ``accelerate launch --multi_gpu --num_processes 2`` on CPU (gloo)."""

import json
import os
import subprocess
import sys

import pytest

from hf_sparsity.storage.masks_file import load_masks

from .conftest import REPO


@pytest.mark.slow
def test_ddp_masks_identical_on_both_ranks_and_trainer_fsdp_argument_runs_where_it_runs(tmp_path):
    """One ``accelerate launch`` of two processes, three Trainers in turn: Llama and GPT-2 on DDP, then Llama
    with ``Trainer(fsdp=...)``, which transformers runs as DDP on CPU (FSDP2 sharding itself is tested
    through ``fully_shard`` in test_fsdp2.py); the invariants hold either way."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", "0",
        str(REPO / "tests" / "scripts" / "ddp_trainer.py"), str(tmp_path), "llama,gpt2,llama:fsdp",
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for run in ("llama", "gpt2", "llama-fsdp"):
        _check_ddp_run(tmp_path / run)
    fsdp = json.loads((tmp_path / "llama-fsdp" / "rank0.json").read_text())
    import torch

    if not torch.cuda.is_available():
        assert not fsdp["fsdp_enabled"] and fsdp["distributed_type"] == "DistributedType.MULTI_CPU"


def _check_ddp_run(out):
    r0 = json.loads((out / "rank0.json").read_text())
    r1 = json.loads((out / "rank1.json").read_text())
    assert r0["world_size"] == 2
    assert r0["masks"] == r1["masks"]  # built independently on each rank, no communication
    assert r0["weights"] == r1["weights"]  # DDP kept replicas in sync, masked weights included
    assert r0["checked_steps"] == r1["checked_steps"] == 5  # invariants checked after every step on each rank
    assert r0["levels"] == [0.75]
    # Batch tokens summed over micro-batches and all-reduced over ranks: steps x accumulation x batch x
    # ranks x block length, the same on both ranks.
    assert r0["tokens"] == r1["tokens"] == 5 * 2 * 4 * 2 * 16
    masks, _ = load_masks(out / "checkpoint-5")
    assert all(int((m == 0).sum()) == round(0.75 * m.numel()) for m in masks.values())
