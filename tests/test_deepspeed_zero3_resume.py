"""DeepSpeed ZeRO-3 resumed from its checkpoint: one ZeRO-3 run (two processes under torchrun, topk masks, a
prune at step 3, saved at step 3) and its single-process reference, built once for this file (a module
fixture: the suite's scheduler keeps the file on one worker), then each way of resuming it in a test of its
own: the same masks and losses, a mask file that does not fit refused, DeepSpeed's universal checkpoint on
one process, and another sparsity level at resume. The two resumed runs on two processes go in the first
run's launch, after it (the same processes: the imports and the process group paid once)."""

import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from hf_sparsity.storage.masks_file import load_masks, save_masks

from .test_deepspeed import ENV, SCRIPT, _check_against_single_process, _launch, _run

ZERO3_TRAIN = ["--init", "topk", "--prune_at", "3"]
ANOTHER_LEVEL = ["--init", "topk", "--sparsity", "0.9"]


@pytest.fixture(scope="module")
def zero3(tmp_path_factory):
    """The reference, then one launch: the ZeRO-3 run, then two runs resumed from its checkpoint-3 (as it
    was, and with another level)."""
    root = tmp_path_factory.mktemp("zero3")
    ref_out, ds_out, resumed, level = root / "single", root / "zero", root / "resumed", root / "level"
    for out in (ref_out, ds_out, resumed, level):
        out.mkdir()
    (ref,) = _run(ref_out, "--stage", "0", *ZERO3_TRAIN, "--save_steps", "3", procs=1)
    ckpt = ds_out / "checkpoint-3"
    runs = _launch(
        {
            ds_out: ["--stage", "3", *ZERO3_TRAIN, "--save_steps", "3"],
            resumed: ["--stage", "3", *ZERO3_TRAIN, "--resume", ckpt],
            level: ["--stage", "3", *ANOTHER_LEVEL, "--resume", ckpt],
        }
    )
    r0, r1 = runs[ds_out]
    return SimpleNamespace(
        ref=ref, r0=r0, r1=r1, ckpt=ckpt, ref_ckpt=ref_out / "checkpoint-3", resumed=runs[resumed],
        level=runs[level],
    )  # fmt: skip


@pytest.mark.slow
def test_zero3_topk_prune_matches_single_process_and_saves_sparse(zero3, tmp_path):
    _check_against_single_process(zero3.ref, zero3.r0, zero3.r1, zero3.ckpt, tmp_path)


@pytest.mark.slow
def test_zero3_resume_restores_masks_bit_identical_and_trains_on(zero3):
    s0, s1 = zero3.resumed
    assert s0["restored_from"] == str(zero3.ckpt)
    assert s0["masks"] == s1["masks"] == zero3.r0["masks"]
    assert s0["violations"] == [0, 0, 0]
    for step in ("4", "5", "6"):
        assert s0["losses"][step] == pytest.approx(zero3.r0["losses"][step], rel=1e-5, abs=1e-5)


@pytest.mark.slow
def test_zero3_resume_refuses_a_mask_file_that_does_not_fit(zero3, tmp_path):
    """Refused before the first step, naming the problem."""
    bad = tmp_path / zero3.ckpt.name
    shutil.copytree(zero3.ckpt, bad)
    masks, _ = load_masks(bad)
    name = sorted(masks)[0]
    masks[name] = torch.ones(3, 5, dtype=torch.uint8)
    save_masks(bad, masks)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(SCRIPT), str(tmp_path), "--stage", "3", *ZERO3_TRAIN, "--resume", str(bad)]  # fmt: skip
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=400)
    assert proc.returncode != 0
    assert f"mask {name!r} has shape [3, 5]" in proc.stdout + proc.stderr
    assert not (tmp_path / "rank0.json").exists()  # no step was trained


@pytest.mark.slow
def test_zero3_universal_checkpoint_resumes_on_another_number_of_processes(zero3, tmp_path, monkeypatch):
    """DeepSpeed's universal checkpoint (its own converter), loaded by one process: the masks come from the
    mask file (full shapes), bit-identical."""
    from deepspeed.checkpoint import ds_to_universal

    ckpt = tmp_path / zero3.ckpt.name
    shutil.copytree(zero3.ckpt, ckpt)
    # ``python -m deepspeed.checkpoint.ds_to_universal ...``, run in this process, its work done in turn (one
    # worker: no process pool for a tiny checkpoint)
    argv = ["--input_folder", str(ckpt / "global_step3"), "--output_folder",
            str(ckpt / "global_step3_universal"), "--inject_missing_state", "--num_extract_workers", "1",
            "--num_merge_workers", "1"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["ds_to_universal", *argv])
    ds_to_universal.main(ds_to_universal.parse_arguments())
    one = tmp_path / "one"
    one.mkdir()
    (u,) = _run(
        one, "--stage", "3", *ZERO3_TRAIN, "--resume", str(ckpt), "--universal", procs=1, torchrun=True
    )
    assert u["world_size"] == 1 and u["restored_from"] == str(ckpt)
    assert u["masks"] == zero3.r0["masks"]
    assert u["violations"] == [0, 0, 0]
    for step in ("4", "5", "6"):
        assert u["losses"][step] == pytest.approx(zero3.r0["losses"][step], rel=1e-4, abs=1e-4)


@pytest.mark.slow
def test_zero3_resume_with_another_level_prunes_as_one_process(zero3, tmp_path):
    """Resumed with another level in the config: pruned further at train begin, as one process does."""
    (sr,) = _run(tmp_path, "--stage", "0", *ANOTHER_LEVEL, "--resume", str(zero3.ref_ckpt), procs=1)
    z0, z1 = zero3.level
    assert z0["events"][-1] == sr["events"][-1] == "resume-level-change"
    assert z0["masks"] == z1["masks"] == sr["masks"]
    assert z0["levels"] == sr["levels"] and min(z0["levels"]) > 0.899
    assert z0["violations"] == [0, 0, 0]
