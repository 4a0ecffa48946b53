"""Folders and files the library writes keep the user's umask, as ``mkdir`` and ``open`` do.

The atomic writers build under a temporary name (``mkdtemp`` makes 0700, ``mkstemp`` and
safetensors' ``save_file`` 0600); what lands at the final name must have the modes a plain
``mkdir`` / ``open`` would give.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hf_sparsity.cli import main
from hf_sparsity.mask_engine.config import SparsityConfig
from hf_sparsity.mask_engine.engine import SparsityEngine

from .conftest import tiny_model

UMASKS = {0o022: (0o755, 0o644), 0o077: (0o700, 0o600), 0o002: (0o775, 0o664)}


@pytest.fixture(params=list(UMASKS), ids=lambda m: f"umask{m:03o}")
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def _assert_modes(folder: Path, umask: int) -> None:
    want_dir, want_file = UMASKS[umask]
    assert _mode(folder) == want_dir, f"{folder}: {_mode(folder):o}"
    files = [p for p in folder.rglob("*") if p.is_file()]
    assert files
    for p in files:
        assert _mode(p) == want_file, f"{p}: {_mode(p):o}"


def _sparse_folder(path: Path) -> Path:
    model = tiny_model("gpt2")
    engine = SparsityEngine(model, SparsityConfig(sparsity=0.5, init_method="topk"))
    engine.build_masks()
    engine.apply()
    engine.install_save_hook()
    model.save_pretrained(path)
    return path


def test_save_pretrained_folder_and_mask_file(tmp_path, umask):
    want_dir, want_file = UMASKS[umask]
    folder = _sparse_folder(tmp_path / "m")
    assert _mode(folder) == want_dir
    assert _mode(folder / "sparsity_masks.safetensors") == want_file  # atomic_path
    assert _mode(folder / "config.json") == want_file


def test_atomic_text_file(tmp_path, umask):
    from hf_sparsity.utils import atomic_write_text

    atomic_write_text(tmp_path / "a.txt", "x")
    assert _mode(tmp_path / "a.txt") == UMASKS[umask][1]


def test_prune_output_keeps_umask(tmp_path, umask):
    src = _sparse_folder(tmp_path / "m")
    assert main(["prune", str(src), str(tmp_path / "p"), "--method", "magnitude", "--no-progress"]) == 0
    _assert_modes(tmp_path / "p", umask)


@pytest.mark.parametrize("mode", ["--finalize", "--to-sentinel"])
def test_convert_output_keeps_umask(tmp_path, umask, mode):
    src = _sparse_folder(tmp_path / "m")
    assert main(["convert", mode, str(src), str(tmp_path / "c")]) == 0
    _assert_modes(tmp_path / "c", umask)


def test_merge_sparse_output_keeps_umask(tmp_path, umask):
    peft = pytest.importorskip("peft")
    from hf_sparsity import merge_sparse

    model = tiny_model("gpt2")
    engine = SparsityEngine(model, SparsityConfig(sparsity=0.5))
    engine.build_masks()
    engine.apply()
    cfg = peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True)
    merge_sparse(peft.get_peft_model(model, cfg), masks=engine.masks, output_dir=tmp_path / "merged")
    _assert_modes(tmp_path / "merged", umask)
