"""DeepSpeed ZeRO-2 / ZeRO-3 through ``Trainer(deepspeed=...)`` on CPU: 2 processes under torchrun (gloo,
DeepSpeed's CPU accelerator), compared with one plain process on the same data. The ZeRO runs go in one
launch, one after the other (a module fixture: the suite's scheduler keeps the file on one worker); each
test reads its own run's results."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hf_sparsity import zero
from hf_sparsity.cli import main as cli_main
from hf_sparsity.storage.masks_file import load_masks
from hf_sparsity.utils import SparsityError, torch_threads

from .conftest import REPO

deepspeed = pytest.importorskip(
    "deepspeed", reason="DeepSpeed is not installed (pip install hf_sparsity[deepspeed])"
)
SCRIPT = REPO / "tests" / "scripts" / "deepspeed_trainer.py"
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), DS_ACCELERATOR="cpu")


def _in_process(out, *args):
    """The single-process reference (``--stage 0``: plain Trainer, no DeepSpeed) run in this process, on
    one torch thread as the launched runs (``OMP_NUM_THREADS=1``): the same numbers without a fresh
    interpreter's imports."""
    spec = importlib.util.spec_from_file_location("deepspeed_trainer_script", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with torch_threads(1):
        script.main([str(out), *map(str, args)])
    return [json.loads((out / "rank0.json").read_text())]


def _aborted_after_results(proc, outs: list[Path], procs) -> bool:
    """A launch whose every rank wrote its results (in every run's folder) and one rank then died of
    SIGABRT (at exit)."""
    done = all((out / f"rank{r}.json").is_file() for out in outs for r in range(procs))
    return proc.returncode != 0 and done and "SIGABRT" in proc.stderr


def _run(out, *args, procs=2, torchrun=False):
    """One run into ``out``: each rank's results."""
    if procs == 1 and not torchrun and args[:2] == ("--stage", "0"):
        return _in_process(out, *args)
    return _launch({out: list(args)}, procs=procs, torchrun=torchrun)[out]


def _launch(runs: dict[Path, list[str]], procs=2, torchrun=False) -> dict[Path, list[dict]]:
    """Several runs (``{out: options}``) one after the other in one launch: each run's ranks' results."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs)]
    cmd = (launcher if procs > 1 or torchrun else [sys.executable]) + [str(SCRIPT)]
    for i, (out, args) in enumerate(runs.items()):
        cmd += (["--then"] if i else []) + [str(out), *map(str, args)]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=400)
    if _aborted_after_results(proc, list(runs), procs):
        # gloo can abort one rank at interpreter exit on a loaded machine, after every rank has written its
        # results and torn its process group down: launch once more, from scratch, rather than read them
        for out in runs:
            for r in range(procs):
                (out / f"rank{r}.json").unlink()
        proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return {out: [json.loads((out / f"rank{r}.json").read_text()) for r in range(procs)] for out in runs}


def _consolidated_and_finalized(ckpt, tmp_path):
    """DeepSpeed's own ``zero_to_fp32`` on the checkpoint, then ``hf_sparsity convert --finalize``."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file, save_file

    fp32 = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
    consolidated = tmp_path / "consolidated"
    consolidated.mkdir()
    for f in ("config.json", "sparsity_masks.safetensors"):
        shutil.copy(ckpt / f, consolidated / f)
    save_file({k: v.contiguous() for k, v in fp32.items()}, consolidated / "model.safetensors")
    out = tmp_path / "final"
    assert cli_main(["convert", "--finalize", str(consolidated), str(out)]) == 0  # the CLI, in this process
    return fp32, load_file(out / "model.safetensors")


def _check_against_single_process(ref, r0, r1, ckpt, tmp_path):
    """Masks identical on both ranks and to the single process (random or topk init, and a magnitude
    prune over the whole tensor at step 3, gathered on every rank: ZeRO-1/2 ranks holding no piece of a
    weight must join the gather too); after every step, read back through DeepSpeed, fp32 masters and Adam
    moments exactly 0 where masked; the losses of one process; the checkpoint consolidated by DeepSpeed's
    own converter and finalized: exact zeros where masked, the kept weights kept."""
    assert r0["masks"] == r1["masks"] == ref["masks"]
    assert r0["events"] == ref["events"]
    assert r0["violations"] == r1["violations"] == [0] * 6
    for step, loss in ref["losses"].items():
        assert r0["losses"][step] == pytest.approx(loss, rel=1e-5, abs=1e-5), step
    masks, _ = load_masks(ckpt)
    assert len(masks) == 14
    fp32, final = _consolidated_and_finalized(ckpt, tmp_path)
    for name, m in masks.items():
        assert tuple(fp32[name].shape) == tuple(m.shape)
        assert torch.count_nonzero(fp32[name][m == 0]) == 0, name  # the master weights DeepSpeed saved
        assert torch.count_nonzero(final[name][m == 0]) == 0, name
        assert torch.count_nonzero(final[name][m == 1]) == int(m.sum())  # and the kept ones survived
    return masks


PRUNE = ["--prune_at", "3", "--save_steps", "6"]
# The ZeRO runs the tests below compare with one process: (stage, training options), by test id.
ZERO_RUNS = {
    "zero1-random-prune": (1, PRUNE),
    "zero2-random-prune": (2, PRUNE),
    "zero2-rigl": (2, ["--rigl"]),
    "zero3-events": (3, ["--events"]),
}


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory):
    """Every run of ZERO_RUNS, one after the other in one launch of two processes (the imports and the
    process group paid once): by id, its folder and its ranks' results."""
    root = tmp_path_factory.mktemp("zero")
    outs = {name: root / name for name in ZERO_RUNS}
    for out in outs.values():
        out.mkdir()
    ranks = _launch({outs[n]: ["--stage", stage, *train] for n, (stage, train) in ZERO_RUNS.items()})
    return {n: (outs[n], ranks[outs[n]]) for n in ZERO_RUNS}


@pytest.mark.slow
@pytest.mark.parametrize("run", ["zero1-random-prune", "zero2-random-prune"])
def test_zero_matches_single_process_and_saves_sparse(run, zero_runs, tmp_path):
    ref_out = tmp_path / "single"
    ref_out.mkdir()
    (ref,) = _run(ref_out, "--stage", "0", *ZERO_RUNS[run][1], procs=1)
    ds_out, (r0, r1) = zero_runs[run]
    _check_against_single_process(ref, r0, r1, ds_out / "checkpoint-6", tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("run", ["zero3-events", "zero2-rigl"])
def test_zero_events_match_single_process(run, zero_runs, tmp_path):
    """Prune (with an LR rewind), regrow and densify under ZeRO-3, and RigL updates under ZeRO-2: after
    every step the masks, the learning rate and the loss are those of one process."""
    train = ZERO_RUNS[run][1]
    ref_out = tmp_path / "single"
    ref_out.mkdir()
    (ref,) = _run(ref_out, "--stage", "0", *train, procs=1)
    _, (r0, r1) = zero_runs[run]
    kinds = ["prune", "regrow", "densify"] if "--events" in train else ["update", "update"]
    assert ref["events"] == r0["events"] == r1["events"] == kinds
    assert r0["trace"] == r1["trace"] == ref["trace"]  # the masks' digest after every step
    assert len(set(ref["trace"])) == len(kinds) + 1  # every event changed the masks
    assert r0["lrs"] == pytest.approx(ref["lrs"], rel=1e-12)
    assert r0["violations"] == r1["violations"] == [0] * 6
    for step, loss in ref["losses"].items():
        assert r0["losses"][step] == pytest.approx(loss, rel=1e-5, abs=1e-5), step
    if "--events" in train:  # the rewind at step 2 sent the schedule back to step 1's learning rate
        assert ref["lrs"][1] == ref["lrs"][0]


def test_meta_model_under_an_active_zero3_config():
    """transformers wraps ``from_config`` in ``deepspeed.zero.Init`` (a collective) while a ZeRO-3 Trainer
    lives; the library's meta models (FLOP counts, model cards: built on one rank) must not be."""
    from transformers import GPT2Config
    from transformers.integrations import HfDeepSpeedConfig

    from hf_sparsity.modeling import meta_causal_lm

    ds = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    model = meta_causal_lm(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64))
    assert all(p.is_meta and not hasattr(p, "ds_id") for p in model.parameters())
    assert tuple(model.get_parameter("transformer.h.0.attn.c_attn.weight").shape) == (32, 96)
    del ds


def test_offload_is_refused_with_what_works():
    fake = SimpleNamespace(cpu_offload=True, fp32_partitioned_groups_flat=[])
    with pytest.raises(SparsityError, match="offload.*stages 1, 2 and 3 without offload"):
        zero.check_supported(fake)
    zero.check_supported(SimpleNamespace(cpu_offload=False, fp32_partitioned_groups_flat=[]))
    zero.check_supported(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1))  # not DeepSpeed


def test_deepspeed_still_offers_what_enforcement_reads():
    """hf_sparsity.zero reads DeepSpeed's tensor-fragment link and its local fp32 API: fail by name if
    a DeepSpeed release moves them."""
    import dataclasses

    from deepspeed.utils import (  # noqa: F401
        safe_get_full_fp32_param,
        safe_get_local_fp32_param,
        safe_get_local_optimizer_state,
    )
    from deepspeed.utils.tensor_fragment import tensor_fragment

    fields = {f.name for f in dataclasses.fields(tensor_fragment)}
    assert {"lp_fragment_address", "hp_fragment"} <= fields
    assert hasattr(tensor_fragment, "set_optim_state_fragment")


def test_only_an_abort_after_every_rank_wrote_is_launched_again(tmp_path):
    """The relaunch covers one case: every rank's results written, then SIGABRT; any other failure fails."""
    aborted = subprocess.CompletedProcess([], 1, "", "traceback : Signal 6 (SIGABRT) received by PID 7")
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    (first / "rank0.json").write_text("{}")
    assert not _aborted_after_results(aborted, [first], 2)  # rank 1 wrote nothing: a real failure
    (first / "rank1.json").write_text("{}")
    assert _aborted_after_results(aborted, [first], 2)
    assert not _aborted_after_results(aborted, [first, second], 2)  # the second run never finished
    (second / "rank0.json").write_text("{}")
    (second / "rank1.json").write_text("{}")
    assert _aborted_after_results(aborted, [first, second], 2)
    other = subprocess.CompletedProcess([], 1, "", "RuntimeError: masks differ")
    assert not _aborted_after_results(other, [first], 2)
    assert not _aborted_after_results(subprocess.CompletedProcess([], 0, "", ""), [first], 2)
