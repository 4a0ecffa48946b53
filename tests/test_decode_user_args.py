"""``benchmarks/decode_user.py``'s arguments: ``--isa`` levels against the CPU's flags, the model specs with
``:int8`` / ``:int8:f32head``, and one-line refusals before anything loads. Cheap: no model, no build."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))  # it imports benchmarks/decode.py as ``decode``
    try:
        spec = importlib.util.spec_from_file_location("_decode_user", BENCH / "decode_user.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))


def test_cpu_flags_read_from_cpuinfo(bench, tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nflags\t\t: fpu sse4_2 avx avx2 fma f16c\n\nprocessor\t: 1\nflags\t: fpu\n"
    )
    assert bench.cpu_flags(str(info)) == {"fpu", "sse4_2", "avx", "avx2", "fma", "f16c"}
    assert bench.cpu_flags(str(tmp_path / "missing")) == set()


def test_isa_levels_against_the_flags(bench):
    avx2 = {"avx", "avx2", "fma", "f16c"}
    assert bench.isa_problem("avx2", avx2) is None
    assert bench.isa_problem("native", set()) is None and bench.isa_problem("scalar", set()) is None
    said = bench.isa_problem("avx2", {"avx", "avx2"})
    assert said == "--isa avx2: this CPU lacks fma, f16c (/proc/cpuinfo flags); pick native or scalar."
    assert "use one of native, avx2, scalar" in bench.isa_problem("avx512", avx2)
    # each level's llama.cpp build: native by the compiler, the others with every extension above it off
    assert bench.LLAMA_CPP_CMAKE["native"] == "-DGGML_NATIVE=ON"
    assert (
        "-DGGML_AVX2=ON" in bench.LLAMA_CPP_CMAKE["avx2"]
        and "-DGGML_AVX512=OFF" in bench.LLAMA_CPP_CMAKE["avx2"]
    )
    assert (
        "-DGGML_AVX2=OFF" in bench.LLAMA_CPP_CMAKE["scalar"]
        and "-DGGML_NATIVE=OFF" in bench.LLAMA_CPP_CMAKE["scalar"]
    )


def test_model_specs(bench):
    assert bench.parse_model("d=DIR") == dict(name="d", folder="DIR", values=None, head=None)
    assert bench.parse_model("d=DIR:int8") == dict(name="d", folder="DIR", values="int8", head=None)
    assert bench.parse_model("d=DIR:int8:f32head") == dict(
        name="d", folder="DIR", values="int8", head="float32"
    )
    for bad in ("DIR", "d=", "d=DIR:f32head", "d=DIR:int4", "d=DIR:int8:int8"):
        with pytest.raises(ValueError, match="NAME=FOLDER|options after FOLDER"):
            bench.parse_model(bad)


def test_main_refuses_a_level_the_cpu_lacks_and_bad_specs_before_loading(bench, monkeypatch, capsys):
    monkeypatch.setattr(bench, "cpu_flags", lambda path="/proc/cpuinfo": {"avx"})
    monkeypatch.delenv("HF_SPARSITY_NATIVE_ISA", raising=False)
    assert bench.main(["d=/nonexistent", "--isa", "avx2"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err
        == "error: --isa avx2: this CPU lacks avx2, fma, f16c (/proc/cpuinfo flags); pick native or scalar."
    )
    assert bench.main(["d=/nonexistent:int8:f32", "--isa", "scalar"]) == 2
    assert "options after FOLDER" in capsys.readouterr().err
    assert "HF_SPARSITY_NATIVE_ISA" not in os.environ  # nothing set, nothing loaded
    with pytest.raises(SystemExit) as e:
        bench.main(["d=/nonexistent", "--isa", "sse"])
    assert e.value.code == 2 and "invalid choice: 'sse'" in capsys.readouterr().err
