"""``hf_sparsity.loading``: the one model-folder loader and the one dtype table."""

from __future__ import annotations

import pytest
import torch

from hf_sparsity import SparsityConfig, SparsityEngine, SparsityError
from hf_sparsity.loading import DTYPES, load_model_folder, resolve_dtype

from .conftest import tiny_model


def test_dtype_names():
    assert resolve_dtype("bf16") is torch.bfloat16 and resolve_dtype("float32") is torch.float32
    assert resolve_dtype(None) is None and resolve_dtype(torch.float16) is torch.float16
    assert set(DTYPES.values()) == {torch.float32, torch.float64, torch.float16, torch.bfloat16}
    with pytest.raises(SparsityError, match="Unknown dtype 'int8'"):
        resolve_dtype("int8")
    with pytest.raises(SparsityError, match="use one of bfloat16, float32"):
        resolve_dtype("float16", allowed=("float32", "bfloat16"))


def test_load_model_folder_applies_the_masks(tmp_path):
    model = tiny_model("llama")
    eng = SparsityEngine(model, SparsityConfig(sparsity=0.5, seed=1))
    eng.build_masks()
    model.save_pretrained(tmp_path / "sparse")  # weights dense at the masked positions; the masks beside
    eng.save(tmp_path / "sparse")
    loaded, masks = load_model_folder(tmp_path / "sparse", dtype="bf16")
    assert set(masks) == set(eng.masks) and not loaded.training
    for name, m in masks.items():
        p = loaded.get_parameter(name)
        assert p.dtype is torch.bfloat16 and torch.all(p[m == 0] == 0), name
    plain, none = load_model_folder(tmp_path / "sparse", masks=False)
    assert none is None and any(torch.any(plain.get_parameter(n)[m == 0] != 0) for n, m in masks.items())
    with pytest.raises(SparsityError, match="no config.json"):
        load_model_folder(tmp_path)
