"""A run killed while Trainer writes a checkpoint resumes from the last complete one, bit for bit.

Real crashes: ``tests/scripts/save_every_step.py`` (tiny Trainer + SparsityCallback, a checkpoint
every step) is SIGKILLed at fixed moments of a save, and at staggered delays after a checkpoint
folder appears; each run a process of its own, forked from a server with the script's libraries imported
(``tests/preloaded.py``). Then the folders such a kill leaves are built by hand, one per way to be partial.
"""

from __future__ import annotations

import itertools
import json
import logging
import multiprocessing
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_sparsity import SparsityError, last_complete_checkpoint, resume_checkpoint
from hf_sparsity.storage.resume import checkpoint_problem

from .preloaded import Server

STEPS = 8
_RUNS = itertools.count()
pytestmark = pytest.mark.slow  # every test starts or reads fresh Trainer processes (the module fixture)


@pytest.fixture(scope="module")
def server():
    """Runs of ``tests/scripts/save_every_step.py`` (its ``run``), on one torch thread."""
    srv = Server("tests.scripts.save_every_step", "run", env={"OMP_NUM_THREADS": "1"})
    yield srv
    srv.close()


def _start(server: Server, out: Path, *args: str) -> tuple[multiprocessing.Process, Path]:
    """A run into ``out``; what it prints goes to a log of its own beside ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.parent / f"{out.name}-run{next(_RUNS)}.log"
    return server.start(log, [str(out), str(STEPS), *args]), log


def _run(server: Server, out: Path, *args: str) -> tuple[int, str]:
    proc, log = _start(server, out, *args)
    proc.join(timeout=300)
    if proc.exitcode is None:
        proc.kill()
        pytest.fail(f"training script hung:\n{log.read_text()[-3000:]}")
    text = log.read_text()
    if proc.exitcode not in (0, -signal.SIGKILL):
        pytest.fail(f"training script failed ({proc.exitcode}):\n{text[-3000:]}")
    return proc.exitcode, text


def _assert_same_final(a: Path, b: Path) -> None:
    for name in ("model.safetensors", "sparsity_masks.safetensors"):
        x, y = load_file(a / "final" / name), load_file(b / "final" / name)
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), (name, k)


def _steps(out: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, server) -> Path:
    out = tmp_path_factory.mktemp("resume") / "uninterrupted"
    assert _run(server, out)[0] == 0
    return out


def test_killed_mid_save_at_each_moment_resumes_from_last_complete(reference, server, tmp_path, caplog):
    """Killed while writing a checkpoint at each moment of a save in turn (the weights, the optimizer, the
    trainer state), each run resuming the one before: every partial folder is found, skipped and named, and
    the run resumed three times ends bit for bit where the uninterrupted one does."""
    out = tmp_path / "run"
    resumed, killed_at = None, None
    for step, moment in [(3, "weights"), (5, "optimizer"), (7, "state")]:
        rc, log = _run(server, out, *(["--resume"] if resumed else []), "--die", f"{step}:{moment}")
        assert rc == -signal.SIGKILL
        assert f"resuming from {resumed}" in log
        assert _steps(out) == list(range(1, step + 1))
        assert checkpoint_problem(out / f"checkpoint-{step}") is not None
        if killed_at:  # the partial folder the kill before left was written again, whole this time
            assert checkpoint_problem(out / f"checkpoint-{killed_at}") is None
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hf_sparsity"):
            assert last_complete_checkpoint(out) == str(out / f"checkpoint-{step - 1}")
        assert f"checkpoint-{step}" in caplog.text
        with pytest.raises(
            SparsityError, match=f"checkpoint-{step - 1}"
        ):  # naming the partial one explicitly
            resume_checkpoint(out, out / f"checkpoint-{step}")
        resumed, killed_at = str(out / f"checkpoint-{step - 1}"), step

    rc, log = _run(server, out, "--resume")
    assert rc == 0 and f"resuming from {resumed}" in log
    result = json.loads((out / "result.json").read_text())
    assert result == {"resumed_from": str(out / "checkpoint-6"), "global_step": STEPS}
    assert all(checkpoint_problem(out / f"checkpoint-{s}") is None for s in range(1, STEPS + 1))
    _assert_same_final(reference, out)


def test_killed_at_staggered_moments_then_resumed(reference, server, tmp_path):
    """SIGKILL as soon as (or shortly after) a checkpoint folder appears, twice, then resume to the end."""
    out = tmp_path / "run"
    for i, (step, delay) in enumerate([(2, 0.0), (5, 0.004)]):
        proc, _ = _start(server, out, *(["--resume"] if i else []))
        target = out / f"checkpoint-{step}"
        deadline = time.monotonic() + 120
        while not target.exists() and proc.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.0005)
        time.sleep(delay)
        proc.kill()
        proc.join(timeout=60)
        last = last_complete_checkpoint(out)
        assert last is not None and checkpoint_problem(last) is None
        newer = [s for s in _steps(out) if s > int(Path(last).name.split("-")[1])]
        assert all(checkpoint_problem(out / f"checkpoint-{s}") for s in newer)
    expected = last_complete_checkpoint(out)
    assert _run(server, out, "--resume")[0] == 0
    assert json.loads((out / "result.json").read_text())["resumed_from"] == expected
    _assert_same_final(reference, out)


# ------------------------------------------------------------------ the folders a kill leaves
def _only(names):
    def make(d: Path) -> None:
        for f in d.iterdir():
            if f.name not in names:
                f.unlink()

    return make


def _truncate(name):
    def make(d: Path) -> None:
        data = (d / name).read_bytes()
        (d / name).write_bytes(data[: len(data) // 2])

    return make


def _tmp_masks(d: Path) -> None:
    # killed while the mask file was being written: its temp file, not the file
    os.replace(d / "sparsity_masks.safetensors", d / ".sparsity_masks.safetensors.abc123.tmp")
    (d / "trainer_state.json").unlink()


PARTIAL = {
    "empty folder": (_only(set()), "no trainer_state.json"),
    "only model.safetensors": (_only({"model.safetensors"}), "no trainer_state.json"),
    "no trainer_state.json": (lambda d: (d / "trainer_state.json").unlink(), "no trainer_state.json"),
    "mask temp file": (_tmp_masks, "no trainer_state.json"),
    "truncated trainer_state.json": (_truncate("trainer_state.json"), "truncated"),
    "truncated model.safetensors": (_truncate("model.safetensors"), "model.safetensors is truncated"),
    "no weights": (lambda d: (d / "model.safetensors").unlink(), "no model weights"),
    "no mask file": (lambda d: (d / "sparsity_masks.safetensors").unlink(), "no sparsity_masks"),
    "truncated mask file": (_truncate("sparsity_masks.safetensors"), "sparsity_masks.safetensors is"),
}


@pytest.mark.parametrize("kind", list(PARTIAL))
def test_partial_folders_are_skipped(kind, reference, tmp_path, caplog):
    make, problem = PARTIAL[kind]
    out = tmp_path / "run"
    for step in (3, 4):
        shutil.copytree(reference / f"checkpoint-{step}", out / f"checkpoint-{step}")
    make(out / "checkpoint-4")
    assert problem in checkpoint_problem(out / "checkpoint-4")
    with caplog.at_level(logging.WARNING, logger="hf_sparsity"):
        assert last_complete_checkpoint(out) == str(out / "checkpoint-3")
    assert "checkpoint-4" in caplog.text and problem in caplog.text
    with pytest.raises(SparsityError, match="resume from .*checkpoint-3"):
        resume_checkpoint(out, str(out / "checkpoint-4"))


def test_a_checkpoint_named_for_another_step_is_partial(reference, tmp_path):
    shutil.copytree(reference / "checkpoint-3", tmp_path / "checkpoint-9")
    assert "records step 3" in checkpoint_problem(tmp_path / "checkpoint-9")


def test_resume_checkpoint_choices(reference, tmp_path):
    assert resume_checkpoint(reference, False) is None
    assert resume_checkpoint(reference, None) is None
    assert resume_checkpoint(reference, True) == str(reference / f"checkpoint-{STEPS}")
    ckpt = str(reference / "checkpoint-2")
    assert resume_checkpoint(reference, ckpt) == ckpt
    assert last_complete_checkpoint(tmp_path) is None  # no checkpoints: start fresh
    shutil.copytree(reference / "checkpoint-1", tmp_path / "checkpoint-1")
    (tmp_path / "checkpoint-1" / "trainer_state.json").unlink()
    with pytest.raises(SparsityError, match="holds no complete one"):
        resume_checkpoint(tmp_path, tmp_path / "checkpoint-1")
