"""The package's floors run one way."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


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


def test_a_deprecation_from_the_package_fails_the_tests_and_one_from_another_library_does_not():
    """pyproject's filterwarnings: the package's own DeprecationWarnings are errors, other libraries' stay
    warnings (the filter is on the module the warning is attributed to)."""
    import warnings

    with pytest.raises(DeprecationWarning, match="old name"):
        warnings.warn_explicit("old name", DeprecationWarning, "x.py", 1, module="hf_sparsity.inference.x")
    with pytest.warns(DeprecationWarning, match="their old name"):
        warnings.warn_explicit("their old name", DeprecationWarning, "x.py", 1, module="transformers.x")


def test_no_module_of_the_package_is_an_old_import_path():
    """Moved modules leave nothing behind: no module of the package re-exports another with a warning."""
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "hf_sparsity").rglob("*.py")
        if "DeprecationWarning" in p.read_text(encoding="utf-8")
    ]
    assert offenders == []
    assert not (ROOT / "hf_sparsity" / "tools").exists()
