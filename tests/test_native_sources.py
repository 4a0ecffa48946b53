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


ALL_FLAGS = ["sse2", "avx2", "fma", "f16c", "bmi2", "avx_vnni", "avx512f"]


@pytest.fixture
def flag_log(fake_build, tmp_path, monkeypatch):
    """(build, the compiler's arguments of each build): a stand-in compiler that logs them."""
    build, _, _ = fake_build
    args = tmp_path / "args.log"
    (tmp_path / "cc").write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then echo "stand-in cc 1.0"; exit 0; fi\n'
        f'echo "$@" >> "{args}"\n'
        'while [ $# -gt 0 ]; do case "$1" in -o) : > "$2"; shift;; esac; shift; done\n'
    )
    monkeypatch.setattr(_native, "_cpu_flags", lambda: ALL_FLAGS)
    return build, args


@pytest.mark.parametrize(
    "level,has,lacks",
    [
        ("native", ["-march=native"], ["-mavxvnni", "x86-64-v3"]),
        ("avx2", ["-march=x86-64-v3"], ["-march=native", "-mavxvnni"]),  # Zen 2 / 3: no AVX-VNNI
        ("avx2-vnni", ["-march=x86-64-v3", "-mavxvnni"], ["-march=native"]),
        ("scalar", [], ["-march", "-mavx"]),
    ],
)
def test_each_isa_level_builds_with_its_target_flags(flag_log, monkeypatch, level, has, lacks):
    build, args = flag_log
    monkeypatch.setenv(_native.ISA_ENV, level)
    build()
    words = args.read_text().split()
    assert "-fopenmp" in words and all(f in words for f in has)
    assert not any(w.startswith(f) for w in words for f in lacks), words


def test_isa_levels_are_cached_apart(flag_log, monkeypatch):
    build, _ = flag_log
    built = set()
    for level in _native.ISA_LEVELS:
        monkeypatch.setenv(_native.ISA_ENV, level)
        built.add(build())
    assert len(built) == len(_native.ISA_LEVELS)


def test_an_unknown_isa_level_is_one_clear_error(flag_log, monkeypatch):
    build, args = flag_log
    monkeypatch.setenv(_native.ISA_ENV, "avx3")
    with pytest.raises(
        ValueError, match=r"HF_SPARSITY_NATIVE_ISA='avx3' is not a level: use one of native, avx2"
    ):
        build()
    assert not args.exists()  # nothing compiled


def test_a_level_the_cpu_lacks_is_one_clear_error(flag_log, monkeypatch):
    build, args = flag_log
    monkeypatch.setattr(_native, "_cpu_flags", lambda: ["sse2", "avx2", "fma", "f16c", "bmi2"])
    monkeypatch.setenv(_native.ISA_ENV, "avx2")
    build()  # has what avx2 needs
    monkeypatch.setenv(_native.ISA_ENV, "avx2-vnni")
    with pytest.raises(
        ValueError, match="HF_SPARSITY_NATIVE_ISA=avx2-vnni: this CPU lacks avx_vnni; use native"
    ):
        build()
    monkeypatch.setattr(_native, "_cpu_flags", lambda: ["sse2"])
    monkeypatch.setenv(_native.ISA_ENV, "avx2")
    with pytest.raises(ValueError, match="lacks avx2, fma, f16c, bmi2"):
        build()


def test_a_compiler_that_cannot_target_the_level_builds_portable(flag_log, tmp_path, monkeypatch):
    build, args = flag_log
    (tmp_path / "cc").write_text(  # rejects every target flag
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then echo "stand-in cc 1.0"; exit 0; fi\n'
        f'echo "$@" >> "{args}"\n'
        'for a in "$@"; do case "$a" in -march*|-mavx*|-mtune*) exit 1;; esac; done\n'
        'while [ $# -gt 0 ]; do case "$1" in -o) : > "$2"; shift;; esac; shift; done\n'
    )
    monkeypatch.setenv(_native.ISA_ENV, "avx2")
    assert os.path.isfile(build())
    tried = args.read_text().splitlines()
    assert "-march=x86-64-v3" in tried[0] and "-march" not in tried[-1] and "-fopenmp" in tried[-1]
