"""The package's floors run one way, and the paths of moved modules still import (with a warning)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

MOVED = [
    ("hf_sparsity.storage.finalize", "hf_sparsity.export.finalize", "finalize_checkpoint"),
    ("hf_sparsity.storage.model_card", "hf_sparsity.export.model_card", "split_front_matter"),
    ("hf_sparsity.lora.merge", "hf_sparsity.export.merge", "merge_sparse"),
]


@pytest.mark.parametrize("old, new, name", MOVED)
def test_old_module_path_warns_and_gives_the_same_object(old, new, name):
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mod = importlib.import_module(old)
    assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught)
    assert getattr(mod, name) is getattr(importlib.import_module(new), name)


def test_old_lora_merge_sparse_name_warns():
    import hf_sparsity
    import hf_sparsity.lora as lora

    with pytest.warns(DeprecationWarning, match="hf_sparsity.export.merge"):
        f = lora.merge_sparse
    assert f is hf_sparsity.merge_sparse


def test_no_two_way_packages_and_no_import_against_the_layer_order():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "code_shape.py"), "--json"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    import json

    shape = json.loads(out)
    assert shape["two_way_pairs"] == []
    assert shape["imports_against_order"] == []
    assert shape["units_without_a_layer"] == []
    assert shape["import_cycles"] == []


def test_a_registered_architecture_is_built_from_its_config_section_and_refused_twice():
    from transformers import GPT2Config

    from hf_sparsity import modeling
    from hf_sparsity.flops import build_meta_model
    from hf_sparsity.ift import FactorizedLinear
    from hf_sparsity.utils import SparsityError

    cfg = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8).to_dict()
    cfg["sparse_ift"] = {"transform": "factorized", "modules": {"transformer.h.0.mlp.c_fc": {"rank": 2}}}
    model = build_meta_model(cfg)
    assert isinstance(model.get_submodule("transformer.h.0.mlp.c_fc"), FactorizedLinear)
    with pytest.raises(SparsityError, match="already has a builder"):
        modeling.register_architecture("sparse_ift", lambda config: None)
