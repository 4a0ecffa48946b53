"""The inference package and the import paths from before it.

Conversion, decoding and the bench library live in ``hf_sparsity.inference``; the old paths keep
working: ``hf_sparsity.inference`` itself still has the conversion's names, and ``hf_sparsity.decoding``
/ ``hf_sparsity.tools.bench`` are the moved modules themselves (an attribute set through the old path
is the one the code reads), importing with a DeprecationWarning. Each import runs in a fresh
interpreter, where the module is imported for the first time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

_PROBE = r"""
import importlib, json, sys, warnings
old, new = sys.argv[1], sys.argv[2]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    mod = importlib.import_module(old)
moved = importlib.import_module(new)
parent, _, leaf = old.rpartition(".")
print(json.dumps({
    "same": mod is moved and getattr(importlib.import_module(parent), leaf) is moved,
    "warnings": [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)],
}))
"""


def _probe(old: str, new: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, old, new], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "old, new",
    [
        ("hf_sparsity.decoding", "hf_sparsity.inference.decoding"),
        ("hf_sparsity.tools.bench", "hf_sparsity.inference.bench"),
    ],
)
def test_old_module_paths_are_the_moved_modules_and_warn(old, new):
    got = _probe(old, new)
    assert got["same"], f"{old} is not {new}"
    assert any(old in w and new in w for w in got["warnings"]), got["warnings"]


def test_the_inference_package_keeps_the_conversion_names_without_warning():
    got = _probe("hf_sparsity.inference", "hf_sparsity.inference")
    assert not got["warnings"], got["warnings"]
    import hf_sparsity.inference as inference
    from hf_sparsity.inference import conversion

    for name in ("sparsify_for_inference", "restore_dense", "SparseLinear", "sparse_layers", "auto_report"):
        assert getattr(inference, name) is getattr(conversion, name)
