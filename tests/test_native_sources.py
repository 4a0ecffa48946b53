"""The native kernel's build sees every source file: the compiled unit finds the pieces it includes, and
the kernel cache key changes when any of them changes (a stale library must never load after an edit to
a file other than ``hfs_kernels.c``).

The compiler here is a stand-in script (it records the files next to the unit and writes an empty
library), so no kernel is compiled; the real build runs in ``test_native_kernels.py``."""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import stat

import pytest

from hf_sparsity.backends import _native


def _includes(name: str, files: dict[str, str], seen: set[str]) -> set[str]:
    """The quoted includes of ``name``, recursively."""
    for inc in re.findall(r'^\s*#\s*include\s+"([^"]+)"', files[name], re.M):
        if inc not in seen:
            seen.add(inc)
            assert inc in files, f"{name} includes {inc!r}, which sources() does not list"
            _includes(inc, files, seen)
    return seen


def test_sources_list_every_file_the_unit_includes():
    files = _native.sources()
    unit = os.path.basename(_native.SOURCE_PATH)
    assert unit in files
    included = _includes(unit, files, set())
    assert included, "the unit includes no piece: is the split undone?"
    on_disk = {n for n in os.listdir(_native.SOURCE_DIR) if n.endswith((".c", ".h", ".cpp"))}
    assert set(files) == on_disk
    # every piece is used: the unit includes every C source and header but itself and the C++ ops
    assert included == on_disk - {unit, "hfs_ops.cpp"}


@pytest.fixture
def fake_build(tmp_path, monkeypatch):
    """_native._build over a copy of csrc/ with a stand-in compiler; returns (build, csrc copy, log)."""
    src = tmp_path / "csrc"
    shutil.copytree(_native.SOURCE_DIR, src, ignore=shutil.ignore_patterns("__pycache__"))
    log = tmp_path / "cc.log"
    cc = tmp_path / "cc"
    # --version: one line; a build: list the files beside the unit it was given, write the output
    cc.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then echo "stand-in cc 1.0"; exit 0; fi\n'
        'out=""; unit=""\n'
        'while [ $# -gt 0 ]; do case "$1" in -o) out="$2"; shift;; *.c) unit="$1";; esac; shift; done\n'
        f'ls "$(dirname "$unit")" > "{log}"\n'
        ': > "$out"\n'
    )
    cc.chmod(cc.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(_native, "SOURCE_DIR", str(src))
    monkeypatch.setattr(_native, "SOURCE_PATH", str(src / "hfs_kernels.c"))
    monkeypatch.setenv("HF_SPARSITY_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_SPARSITY_NATIVE_ISA", raising=False)
    return (lambda: _native._build(str(cc))), src, log


def test_the_compiler_finds_every_piece_beside_the_unit(fake_build):
    build, src, log = fake_build
    build()
    assert set(log.read_text().split()) >= set(_native.sources())


@pytest.mark.parametrize("piece", ["hfs_kernels.c", "simd.h", "spmm.c", "decode.c", "api.h"])
def test_the_cache_key_changes_with_every_piece(fake_build, piece):
    build, src, _ = fake_build
    first = build()
    assert build() == first  # unchanged sources: the cached library
    with open(src / piece, "a", encoding="utf-8") as f:
        f.write("\n/* an edit */\n")
    assert build() != first, f"an edit to {piece} would load the library built before it"


def test_processes_building_at_once_compile_once(fake_build, tmp_path):
    # the ranks of a launcher (or parallel test workers) starting together: one compiles, the others wait
    # for it and load its library instead of compiling the same one beside it
    build, _, _ = fake_build
    runs = tmp_path / "runs"
    (tmp_path / "cc").write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then echo "stand-in cc 1.0"; exit 0; fi\n'
        f'echo run >> "{runs}"; sleep 1\n'
        'while [ $# -gt 0 ]; do case "$1" in -o) : > "$2"; shift;; esac; shift; done\n'
    )
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        built = list(pool.map(lambda _: build(), range(3)))
    assert len(set(built)) == 1 and os.path.isfile(built[0])
    assert runs.read_text().split() == ["run"]
