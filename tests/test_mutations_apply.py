"""Every mutation in ``benchmarks/mutations.py`` still applies to the code as it stands.

A mutation whose text no longer occurs exactly once in its file cannot be put in, so
``benchmarks/mutations.py`` would report it as an error rather than check the tests that
should catch it; code moves and rewrites must carry their mutations along. Cheap: it reads
files, it runs nothing.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _mutations():
    spec = importlib.util.spec_from_file_location("_mutations", ROOT / "benchmarks" / "mutations.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.MUTATIONS


MUTATIONS = _mutations()


def test_mutation_names_are_unique():
    names = [m.name for m in MUTATIONS]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.name)
def test_each_mutation_applies_once_and_names_existing_tests(mutation):
    for file, old, new in mutation.edits:
        path = ROOT / file
        assert path.is_file(), f"{mutation.name}: {file} does not exist"
        assert old != new, f"{mutation.name}: an edit that changes nothing"
        count = path.read_text(encoding="utf-8").count(old)
        assert count == 1, f"{mutation.name}: {old!r} occurs {count} times in {file} (must be once)"
    assert mutation.tests, f"{mutation.name}: no test listed to catch it"
    for test in mutation.tests:
        file, _, node = test.partition("::")
        assert (ROOT / file).is_file(), f"{mutation.name}: {test} does not exist"
        name = node.split("::")[-1].split("[")[0]  # a test function (or class), its parameters dropped
        if name:
            text = (ROOT / file).read_text(encoding="utf-8")
            assert f"def {name}(" in text or f"class {name}" in text, f"{mutation.name}: no {name} in {file}"
