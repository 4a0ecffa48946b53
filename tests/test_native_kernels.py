"""Every native kernel against the emulator over every input width 1..130 and odd output widths.

One sweep per (format, value type, batch path): the batch-1 decode path, the small-batch row kernels
(2-16 rows) and the blocked batched kernel (17+ rows), for fp32, bf16 and int8 values. A SIMD loop
bound off by one shows at the widths where a vector tail starts (8, 16, 24, 32, ..., 120, 128). The
int8 formats are checked against the emulator on their dequantized weight. The same sweep runs at every
other instruction-set level the CPU can build (``HF_SPARSITY_NATIVE_ISA``: avx2, avx2-vnni, scalar; each a
subprocess), so every vector path is covered. int8 values with int8 activations (the default) are checked on
their dequantized weight and their dequantized activations (``quantize_activations``): the batch-1 path
multiplies the int8 codes (AVX-512 VNNI, AVX-VNNI or AVX2's vpmaddubsw), the others the dequantized
activations, and both must give that sum; :func:`extreme_codes` checks the int8 products where 16-bit pair
sums would saturate.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from hf_sparsity.backends import _native, get_backend
from hf_sparsity.backends.formats import quantize_activations

NATIVE = _native.load() is not None
pytestmark = pytest.mark.skipif(not NATIVE, reason="native kernel did not build (no C compiler)")

WIDTHS = range(1, 131)
OUT_WIDTHS = (1, 7, 13)
BATCHES = {"decode": 1, "rows": 5, "blocked": 19}

# (format, value type): every combination a native kernel serves
KERNELS = [
    ("csr", "fp32"),
    ("bitmask", "fp32"),
    ("bitmask", "bf16"),
    ("bitmask", "int8"),
    ("bitmask", "int8-float-act"),
    ("nm24", "fp32"),
    ("nm24", "bf16"),
    ("nm24", "int8"),
    ("nm24", "int8-float-act"),
    ("native_dense", "fp32"),
    ("native_dense", "bf16"),
    ("native_dense", "int8"),
    ("native_dense", "int8-float-act"),
]


def _mask(name: str, out_f: int, in_f: int, g: torch.Generator) -> torch.Tensor:
    if name == "nm24":  # 2:4 with some groups keeping fewer (padded slots)
        keep = torch.rand(out_f, in_f // 4, 4, generator=g).argsort(-1).argsort(-1) < 2
        drop = torch.rand(out_f, in_f // 4, 4, generator=g) < 0.2
        return (keep & ~drop).reshape(out_f, in_f).to(torch.uint8)
    if name == "native_dense":
        return torch.ones(out_f, in_f, dtype=torch.uint8)
    return (torch.rand(out_f, in_f, generator=g) < 0.5).to(torch.uint8)


def sweep(name: str, vtype: str) -> int:
    """Compare one kernel with the emulator over every width and every batch path (one backend with
    ``prefill="native"`` serves all three); returns the number of shapes checked."""
    g = torch.Generator().manual_seed(len(name) * 131 + len(vtype))
    dtype = torch.bfloat16 if vtype == "bf16" else torch.float32
    opts = {"kernel": "native", "threads": 1}  # one thread: no team wake-up per call (the sweep stays fast)
    if vtype.startswith("int8"):
        opts["values"] = "int8"
        opts["activations"] = "float32" if vtype == "int8-float-act" else "int8"
    if name != "csr":
        opts["prefill"] = "native"  # batches above 16 rows on the blocked kernel, not a dense GEMM
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=3e-2)
    splits = [BATCHES[p] for p in BATCHES]
    checked = 0
    for in_f in WIDTHS:
        if name == "nm24" and in_f % 4:
            continue
        for out_f in OUT_WIDTHS:
            w = (torch.randn(out_f, in_f, generator=g) / math.sqrt(in_f)).to(dtype)
            mask = _mask(name, out_f, in_f, g)
            b = get_backend(name).from_dense(w, mask, **opts)
            # the weight (and activations) it computes with
            wd = b._unpack().float() if vtype.startswith("int8") else (w.float() * mask)
            emu = get_backend("emulator").from_dense(wd, mask, float64_accumulator=True)
            x = torch.randn(sum(splits), in_f, generator=g).to(dtype)
            bias = torch.randn(out_f, generator=g).to(dtype)
            xe = quantize_activations(x) if vtype == "int8" else x.float()
            wants = emu.linear(xe, bias.float()).split(splits)
            for path, xb, want in zip(BATCHES, x.split(splits), wants):
                got = b.linear(xb, bias).float()
                if not torch.allclose(got, want, **tol):  # assert_close is slow; it explains a failure
                    where = f"{name} {vtype} {path} {out_f}x{in_f}"
                    torch.testing.assert_close(got, want, **tol, msg=lambda m, where=where: f"{where}: {m}")
            checked += 1
    return checked


@pytest.mark.parametrize("name,vtype", KERNELS, ids=[f"{n}-{v}" for n, v in KERNELS])
def test_native_kernel_matches_emulator_at_every_width(name, vtype):
    assert sweep(name, vtype) > 0


def extreme_codes() -> int:
    """int8 x int8 products at the largest codes: every weight +-1 of its row's maximum (codes +-127) and
    every activation 1 (codes 127), so a pair of adjacent products sums to +-2 * 127 * 127 in 16 bits
    (vpmaddubsw saturates at 32767: unsigned weight codes w + 128 would reach 255 * 127 * 2) and rows of one
    sign reach 127 * 127 * in in int32. The sum is exact: the definition is the float64 sum of the
    dequantized codes."""
    g = torch.Generator().manual_seed(11)
    checked = 0
    shapes = [("bitmask", 1536), ("bitmask", 200), ("nm24", 1536), ("nm24", 584), ("native_dense", 1536)]
    for name, in_f in [*shapes, ("native_dense", 100)]:
        sign = torch.where(torch.rand(6, in_f, generator=g) < 0.5, -1.0, 1.0)
        sign[0], sign[1] = 1.0, -1.0  # rows of one sign: the largest sums
        mask = _mask(name, 6, in_f, g)
        if name == "bitmask":
            mask[0], mask[1] = 1, 1
        b = get_backend(name).from_dense(sign, mask, kernel="native", threads=1, values="int8")
        x = torch.ones(1, in_f)
        s = (1 / torch.tensor(127.0)).double()  # the activations' scale, float32 as the kernels keep it
        want = ((sign * mask).double() * s.float().double() * 127 * (s.float().double() * 127)).sum(1)
        got = b.linear(x)[0].double()
        torch.testing.assert_close(
            got, want, rtol=1e-6, atol=1e-6, msg=lambda m, n=f"{name} {in_f}": f"{n}: {m}"
        )
        checked += 1
    return checked


def test_int8_products_exact_at_extreme_codes():
    assert extreme_codes() == 6


def test_int8_dequantized_weight_is_close_and_compact():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 256, generator=g)
    mask = (torch.rand(64, 256, generator=g) < 0.5).to(torch.uint8)
    b = get_backend("bitmask").from_dense(w, mask, values="int8")
    wd = b.to_dense()
    assert torch.equal(wd != 0, (w * mask) != 0) or bool(((wd != 0) <= mask.bool()).all())
    step = (w * mask).abs().amax(1, keepdim=True) / 127
    assert bool(((wd - w * mask).abs() <= step / 2 + 1e-7).all())  # round to nearest
    # 0.625 B/weight + row offsets and scales, + the 64 bytes of padding after the codes (whole-vector loads)
    assert (b.storage_bytes - 64) / w.numel() < 0.5 * 1 + 0.125 + 0.05


def _cpu_has(*flags: str) -> bool:
    return set(flags) <= set(_native._cpu_flags())


# every level this CPU can build besides native: (HF_SPARSITY_NATIVE_ISA, what isa() reports, int8_dot())
LEVELS = [
    pytest.param("avx2", "avx2", "avx2", marks=pytest.mark.skipif(not _cpu_has("avx2", "fma", "f16c", "bmi2"),
                                                                  reason="no AVX2")),
    pytest.param("avx2-vnni", "avx2-vnni", "avx-vnni",
                 marks=pytest.mark.skipif(not _cpu_has("avx2", "fma", "f16c", "bmi2", "avx_vnni"),
                                          reason="no AVX-VNNI")),
    pytest.param("scalar", "scalar", "float"),
]  # fmt: skip


@pytest.mark.slow  # a second build (its own flags) and the whole sweep again, in a subprocess
@pytest.mark.parametrize("level,isa,dot", LEVELS)
@pytest.mark.parametrize("kernels", ["csr-bitmask", "nm24-dense", "int8"])  # three parts: each under a minute
def test_every_isa_level_matches_emulator_at_every_width(level, isa, dot, kernels):
    # the kernels of another instruction-set level (the AVX2 ones an AVX-512 machine skips, the 256-bit int8
    # products, the scalar loops), built into a separate cache entry: the flags key the build
    env = {**os.environ, _native.ISA_ENV: level}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    which = [k for k in KERNELS if k[1].startswith("int8") == (kernels == "int8")]
    if kernels != "int8":
        which = [k for k in which if (k[0] in ("csr", "bitmask")) == (kernels == "csr-bitmask")]
    code = (
        f"import sys; sys.path.insert(0, {root!r})\n"
        "from tests.test_native_kernels import extreme_codes, sweep\n"
        "from hf_sparsity.backends import _native\n"
        "got = (_native.isa(), _native.int8_dot())\n"
        f"assert got == ({isa!r}, {dot!r}), got\n"
        f"for n, v in {which!r}:\n"
        "    sweep(n, v)\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.slow  # a real build (the portable flags, into a cache of its own), in a subprocess
def test_a_build_without_avx2_runs_scalar_with_one_logged_line(tmp_path):
    # a compiler that cannot target the CPU (every -march / -mavx flag refused): the portable build loads and
    # says so once; its products still match the definition
    cc = tmp_path / "cc"
    real = _native.c_compiler()
    cc.write_text(
        f'#!/bin/sh\nfor a in "$@"; do case "$a" in -march*|-mavx*) exit 1;; esac; done\nexec {real} "$@"\n'
    )
    cc.chmod(0o755)
    env = {
        **os.environ,
        "CC": str(cc),
        _native.ISA_ENV: "native",
        "HF_SPARSITY_CACHE": str(tmp_path / "cache"),
    }
    code = (
        "import logging, torch\n"
        "logging.basicConfig(level=logging.WARNING, format='%(message)s')\n"
        "from hf_sparsity.backends import _native, get_backend\n"
        "print(_native.isa(), _native.int8_dot())\n"
        "w = torch.randn(5, 40); m = (torch.rand(5, 40) < 0.5).to(torch.uint8); x = torch.randn(1, 40)\n"
        "got = get_backend('bitmask').from_dense(w, m, kernel='native').linear(x)\n"
        "torch.testing.assert_close(got.double(), x.double() @ (w * m).double().t(), rtol=1e-5, atol=1e-5)\n"
        "_native.load(); _native.isa()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["scalar", "float"]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "scalar loops" in lines[0] and "HF_SPARSITY_NATIVE_ISA=native" in lines[0], (
        lines
    )


@pytest.mark.slow  # the decoding tests again at another level, in a subprocess
@pytest.mark.parametrize("level,isa,dot", LEVELS[:2])
def test_decode_step_with_int8_activations_at_each_avx2_level(level, isa, dot):
    # the C decoding step's fused products (q / k / v and gate / up quantize their input once, hfs_run_fused)
    # on the 256-bit int8 kernels: the same tokens as the forward loop's one product per call
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    test = "tests/test_realistic_decode.py::test_native_step_matches_the_model_on_every_format"
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "-k", "int8", test]
    proc = subprocess.run(args, cwd=root, env={**os.environ, _native.ISA_ENV: level}, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0 and "4 passed" in proc.stdout, proc.stdout[-3000:]
