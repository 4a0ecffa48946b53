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
    assert shape["shims"] == []
    assert shape["functions_over_limit"] == {} and shape["c_functions_over_limit"] == {}
    assert shape["c_functions"] > 50  # the C kernels are measured, not skipped


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


def _code_shape():
    import importlib.util

    spec = importlib.util.spec_from_file_location("code_shape", ROOT / "benchmarks" / "code_shape.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


C_SOURCE = """#include "x.h"
#define TWICE(x) { (x) + (x); }
/* a comment with { braces } and f(void) { */
typedef struct { int a; } pair_t;
static const int TABLE[2] = {1, 2};
enum kind { A, B };
static int three(int a) {
  return a;   // "}" in a comment
}
MACRO_THAT_DEFINES(x)

static inline __attribute__((always_inline)) void
long_one(const char* s, int n)
{
  const char* t = "{ not a brace";
  char c = '}';
  for (int i = 0; i < n; i++) {
    if (s[i] == c) { return; }
  }
  (void)t;
}
"""


def test_code_shape_measures_every_c_function_from_its_name_to_its_closing_brace(tmp_path):
    cs = _code_shape()
    src = tmp_path / "x.c"
    src.write_text(C_SOURCE)
    # three: lines 7-9; long_one: the line naming it (13) to its closing brace (21)
    assert cs.c_functions(src) == [("three", 3, False), ("long_one", 9, False)]
    src.write_text("void f(void) {\n  /* Long by design: one table */\n}\n")
    assert cs.c_functions(src) == [("f", 3, True)]


def test_code_shape_counts_old_import_paths_as_shims(tmp_path):
    import ast

    cs = _code_shape()

    def shim(text, name="m.py"):
        path = tmp_path / name
        path.write_text(text)
        return cs._shim(path, ast.parse(text), text)

    assert shim('"""Old path."""\nfrom .new import thing\n__all__ = ["thing"]\n')  # only re-exports
    assert shim("import warnings\nwarnings.warn('moved', DeprecationWarning)\n")
    assert shim("def __getattr__(name):\n    return 1\n")  # a forwarding module without a lazy face
    assert not shim("# Lazy imports: x\ndef __getattr__(name):\n    return 1\n", "__init__.py")
    assert not shim("from .a import b\n", "__init__.py")  # a package face
    assert not shim("from .a import b\n\ndef f():\n    return b\n")


def test_contributing_names_every_module_and_kernel_source():
    """The layout in CONTRIBUTING.md lists every module of the package and every C / C++ source."""
    import re

    text = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    layout = text.split("## Module layout", 1)[1].split("```")[1]
    pkg = ROOT / "hf_sparsity"
    sources = [p for ext in ("py", "c", "h", "cpp") for p in pkg.rglob(f"*.{ext}") if p.stem != "__init__"]
    missing = sorted(
        str(p.relative_to(pkg))
        for p in sources
        if not re.search(rf"(?<![\w]){re.escape(p.stem)}(?![\w])", layout)
    )
    assert missing == []
    for d in sorted(q for q in pkg.iterdir() if q.is_dir() and (q / "__init__.py").is_file()):
        assert f"{d.name}/" in layout, d.name
