"""Sparse backends: registry, parity with the emulator (forward and backward), emulator counters and order."""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from hf_sparsity import masks as M
from hf_sparsity.backends import (
    EmulatorBackend,
    MachineSpec,
    SparseBackend,
    _native,
    available_backends,
    backend_table,
    check_nm,
    get_backend,
    normalize_name,
    register_backend,
)
from hf_sparsity.backends.formats import SMALL_BATCH
from hf_sparsity.utils import SparsityError

CUDA = torch.cuda.is_available()
NATIVE = _native.load() is not None

# (backend, options, device): every backend and kernel this machine can run; GPU ones skip without CUDA.
gpu = pytest.mark.gpu
CASES = [
    pytest.param("masked_dense", {}, "cpu", id="masked_dense"),
    pytest.param(
        "csr",
        {"kernel": "native"},
        "cpu",
        id="csr-native",
        marks=pytest.mark.skipif(not NATIVE, reason="native kernel did not build"),
    ),
    pytest.param("csr", {"kernel": "torch"}, "cpu", id="csr-torch"),
    pytest.param(
        "masked_dense",
        {},
        "cuda",
        id="masked_dense-cuda",
        marks=[gpu, pytest.mark.skipif(not CUDA, reason="no CUDA")],
    ),
    pytest.param(
        "csr", {}, "cuda", id="csr-cuda", marks=[gpu, pytest.mark.skipif(not CUDA, reason="no CUDA")]
    ),
]

# (batch, out, in): batch 1 (decoding) and odd sizes; GPT-2-small layers in test_parity_gpt2_small_shapes.
SHAPES = [(1, 1, 1), (1, 33, 17), (3, 64, 48), (7, 130, 257)]
LEVELS = [0.0, 0.5, 0.9, 0.99]
DTYPES = [torch.float32, torch.float64, torch.bfloat16]
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float64: dict(rtol=1e-10, atol=1e-10),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
}


def _problem(batch, out_f, in_f, level, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed + 1000 * out_f + in_f)
    w = (torch.randn(out_f, in_f, generator=g) / math.sqrt(in_f)).to(dtype)
    x = torch.randn(batch, in_f, generator=g).to(dtype)
    gy = torch.randn(batch, out_f, generator=g).to(dtype)
    mask = M.random_mask((out_f, in_f), level, seed, f"{out_f}x{in_f}")
    return w.to(device), mask.to(device), x.to(device), gy.to(device)


def _run(backend, w, mask, x, gy, **opts):
    """Forward + backward through ``backend``; returns (y, grad x, grad w)."""
    w = w.clone().requires_grad_(True)
    x = x.clone().requires_grad_(True)
    b = get_backend(backend).from_dense(w, mask, **opts)
    y = b.linear(x)
    y.backward(gy)
    return y.detach(), x.grad, w.grad, b


def _reference(w, mask, x, gy):
    return _run("emulator", w.cpu(), mask.cpu(), x.cpu(), gy.cpu(), float64_accumulator=True)


@functools.cache
def _cached_reference(shape, level, dtype):
    """The emulator's answer for one parity problem, shared by every backend tested on it."""
    w, mask, x, gy = _problem(*shape, level, dtype)
    return _reference(w, mask, x, gy)


# ---------------------------------------------------------------------------- registry
def test_registry_names_aliases_and_errors():
    assert {"masked_dense", "csr", "emulator", "semi_structured"} <= set(available_backends(all=True))
    assert {"masked_dense", "csr", "emulator"} <= set(available_backends())
    assert normalize_name(" Masked-Dense ") == "masked_dense"
    assert get_backend("Masked-Dense").name == "masked_dense"
    assert get_backend("reference") is EmulatorBackend
    with pytest.raises(SparsityError, match="Unknown sparse backend 'nope'.*Registered"):
        get_backend("nope")

    class Dup(SparseBackend):
        name = "csr"

    with pytest.raises(SparsityError, match="already registered"):
        register_backend(Dup)
    with pytest.raises(SparsityError, match="already registered"):
        register_backend(Dup, name="mine", aliases=("emulator",))
    assert "mine" not in available_backends(all=True)
    rows = {r["name"]: r for r in backend_table()}
    assert rows["masked_dense"]["training"] and rows["emulator"]["training"] and not rows["csr"]["training"]
    assert rows["semi_structured"]["structure"] == "2:4"


@pytest.mark.skipif(CUDA, reason="checks the CPU-only message")
def test_semi_structured_unavailable_without_cuda_is_clear():
    assert "semi_structured" not in available_backends()
    with pytest.raises(SparsityError, match="semi_structured.*CUDA"):
        get_backend("semi_structured")
    with pytest.raises(SparsityError, match="CUDA"):
        get_backend("semi_structured", check_available=False).from_dense(torch.ones(4, 4))


def test_import_does_not_initialize_cuda():
    code = (
        "import torch, hf_sparsity.backends, hf_sparsity.inference, hf_sparsity.cli.bench, "
        "hf_sparsity.import_utils\n"
        "hf_sparsity.backends.get_backend('csr')\n"
        "assert not torch.cuda.is_initialized(), 'CUDA initialized on import'\n"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


# ---------------------------------------------------------------------------- parity
@pytest.mark.parametrize("backend,opts,device", CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_parity_with_emulator(backend, opts, device, dtype, level, shape):
    if opts.get("kernel") == "native" and dtype == torch.float64:
        pytest.skip("native kernel computes in float32; float64 uses the torch kernel")
    w, mask, x, gy = _problem(*shape, level, dtype, device)
    y, gx, gw, b = _run(backend, w, mask, x, gy, **opts)
    ry, rgx, rgw, ref = _cached_reference(shape, level, dtype)
    tol = TOL[dtype]
    torch.testing.assert_close(y.cpu(), ry, **tol)
    torch.testing.assert_close(gx.cpu(), rgx, **tol)
    torch.testing.assert_close(gw.cpu(), rgw, **tol)
    assert y.dtype == gx.dtype == gw.dtype == dtype
    assert torch.all(gw.cpu()[mask.cpu() == 0] == 0), "a pruned weight received a gradient"
    torch.testing.assert_close(b.to_dense().cpu(), ref.to_dense(), rtol=0, atol=0)


@pytest.mark.parametrize("backend,opts,device", CASES)
@pytest.mark.parametrize("shape", [(1, 768, 3072), (4, 2304, 768)], ids=lambda s: "x".join(map(str, s)))
def test_parity_gpt2_small_shapes(backend, opts, device, shape):
    w, mask, x, gy = _problem(*shape, 0.9, torch.float32, device)
    y, gx, gw, _ = _run(backend, w, mask, x, gy, **opts)
    ry, rgx, rgw, _ = _cached_reference(shape, 0.9, torch.float32)
    for got, want in ((y, ry), (gx, rgx), (gw, rgw)):
        torch.testing.assert_close(got.cpu(), want, **TOL[torch.float32])


def test_parity_leading_dims_bias_and_random_shapes():
    g = torch.Generator().manual_seed(7)
    for _ in range(6):
        out_f, in_f = (int(v) for v in torch.randint(1, 200, (2,), generator=g))
        level = float(torch.rand((), generator=g))
        w, mask, _, _ = _problem(1, out_f, in_f, level, torch.float32)
        x = torch.randn(4, 8, in_f, generator=g)  # 32 rows: the batched kernels
        bias = torch.randn(out_f, generator=g)
        ref = get_backend("emulator").from_dense(w, mask, float64_accumulator=True).linear(x, bias)
        for name in ("masked_dense", "csr"):
            got = get_backend(name).from_dense(w, mask).linear(x, bias)
            assert got.shape == (4, 8, out_f)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_mask_wins_over_weight_and_default_mask_is_zeros():
    w = torch.randn(8, 12)
    mask = M.random_mask((8, 12), 0.5, 0, "w")
    x = torch.randn(2, 12)
    want = x @ (w * mask).t()
    for name in available_backends():
        if name == "semi_structured" or get_backend(name).capabilities.structure:
            continue
        torch.testing.assert_close(get_backend(name).from_dense(w, mask).linear(x), want)
    wz = w * mask
    assert get_backend("csr").from_dense(wz).nnz == int(mask.sum())


@pytest.mark.skipif(not NATIVE, reason="native kernel did not build")
def test_native_kernel_wide_batch_and_wide_input():
    # batch > 64 exercises the accumulator tiling; in > 65536 the 32-bit index path
    for batch, out_f, in_f in [(130, 40, 50), (2, 5, 70000), (1, 3, 70000)]:
        w, mask, x, _ = _problem(batch, out_f, in_f, 0.9, torch.float32)
        b = get_backend("csr").from_dense(w, mask, kernel="native")
        assert b.kernel == "native"
        ref = get_backend("emulator").from_dense(w, mask, float64_accumulator=True).linear(x)
        torch.testing.assert_close(b.linear(x), ref, rtol=1e-5, atol=1e-5)
        for threads in (1, 3):
            torch.testing.assert_close(
                get_backend("csr").from_dense(w, mask, threads=threads).linear(x), ref, rtol=1e-5, atol=1e-5
            )


@pytest.mark.skipif(not NATIVE, reason="native kernel did not build")
@pytest.mark.parametrize("name", ["bitmask", "nm24", "csr"])
def test_blocked_batched_kernel_matches_a_float64_product(name):
    # batches of 17 rows or more (prefill) go through the blocked kernel: full x blocks of 128 (AVX-512) and
    # every width of the last one, several column tiles and row blocks, an input width that is not a multiple
    # of 8 (and, for 2:4, of 8 but 4), 32-bit CSR indices, bias, one and two threads
    g = torch.Generator().manual_seed(21)
    threads = torch.get_num_threads()
    shapes = [(70, 604), (33, 1100)] + ([(3, 70000)] if name == "csr" else [])
    try:
        for out_f, in_f in shapes:
            mask = (
                _nm24_mask(out_f, in_f, g)
                if name == "nm24"
                else (torch.rand(out_f, in_f, generator=g) >= 0.6).to(torch.uint8)
            )
            w = torch.randn(out_f, in_f, generator=g) / math.sqrt(in_f)
            bias = torch.randn(out_f, generator=g)
            for dtype in (torch.float32, torch.bfloat16) if name != "csr" else (torch.float32,):
                opts = {"kernel": "native"} if name == "csr" else {"prefill": "native"}
                b = get_backend(name).from_dense(w.to(dtype), mask, **opts)
                want_w = (w.to(dtype).float() * mask).t()
                for batch in (17, 47, 128, 161, 300) if in_f < 5000 else (20, 130):
                    x = torch.randn(batch, in_f, generator=g)
                    want = x.double() @ want_w.double() + bias.double()
                    for nt in (1, 2):
                        torch.set_num_threads(nt)
                        got = b.linear(x, bias)
                        assert got.shape == (batch, out_f)
                        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
            if name == "csr" and _native.simd():  # kernel="auto" keeps batches on the native kernel too
                b = get_backend("csr").from_dense(w, mask)
                torch.testing.assert_close(b.linear(x, bias).double(), want, rtol=1e-4, atol=1e-4)
                assert b._torch is None, "a batch went to torch.sparse"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow  # a fresh interpreter
@pytest.mark.skipif(not NATIVE, reason="native kernel did not build")
def test_blocked_kernel_work_memory_small_stacks_and_thread_counts():
    # its scratch lives in per-thread work memory, freed when a thread exits (short-lived threads each used
    # to leave their x copy behind); its frame is small (a thread with a 128 KiB stack used to crash);
    # a thread count below 1 runs on one thread (it used to divide by zero or return uninitialized rows)
    code = (
        "import threading, torch\n"
        "from hf_sparsity.backends import get_backend, _native\n"
        "torch.manual_seed(0)\n"
        "w = torch.randn(16, 4096); m = (torch.rand(16, 4096) < 0.5).to(torch.uint8)\n"
        "b = get_backend('bitmask').from_dense(w, m, prefill='native', threads=1)\n"
        "x = torch.randn(512, 4096)\n"  # an 8 MiB x copy per calling thread
        "want = x.double() @ (w * m).t().double()\n"
        "errs = []\n"
        "def call(xx=x, ww=want):\n"
        "    with torch.no_grad():\n"
        "        errs.append(float((b.linear(xx).double() - ww).abs().max()))\n"
        "rss = lambda: int(open('/proc/self/statm').read().split()[1]) * 4096 >> 20\n"
        "call(); before = rss()\n"
        "for _ in range(20):\n"
        "    t = threading.Thread(target=call); t.start(); t.join()\n"
        "grown = rss() - before\n"
        "threading.stack_size(128 * 1024)\n"
        "x17, w17 = x[:17], want[:17]\n"
        "t = threading.Thread(target=call, args=(x17, w17)); t.start(); t.join()\n"
        "for nt in (0, -1):\n"
        "    y = _native.run_op('bitmask', 16, 4096, x17, b.values, b.bits, b.rowptr, None, nt, chunk=16)\n"
        "    errs.append(float((y.double() - w17).abs().max()))\n"
        "    bn = get_backend('bitmask').from_dense(w, m, prefill='native', threads=nt)\n"
        "    errs.append(float((bn.linear(x17).double() - w17).abs().max()))\n"
        "print(len(errs), max(errs) < 1e-3, grown < 64)\n"
    )
    assert _run_fresh(code) == ["26", "True", "True"]


@pytest.mark.skipif(not NATIVE, reason="native kernel did not build")
@pytest.mark.parametrize("in_f", [48, 70000], ids=["16-bit-indices", "32-bit-indices"])
def test_native_kernel_every_row_length(in_f):
    # row r keeps r weights: covers the 16-wide and 8-wide vector steps and every scalar tail
    g = torch.Generator().manual_seed(3)
    out_f = 41
    mask = torch.zeros(out_f, in_f, dtype=torch.uint8)
    for r in range(out_f):
        mask[r, torch.randperm(in_f, generator=g)[:r]] = 1
    w = torch.randn(out_f, in_f, generator=g) * mask
    x = torch.randn(1, in_f, generator=g)
    bias = torch.randn(out_f, generator=g)
    ref = get_backend("emulator").from_dense(w, mask, float64_accumulator=True).linear(x, bias)
    b = get_backend("csr").from_dense(w, mask, kernel="native")
    for threads in (1, 2):
        b.threads = threads
        torch.testing.assert_close(b.linear(x, bias), ref, rtol=1e-5, atol=1e-5)


def _run_fresh(code: str, **env) -> list[str]:
    """Run ``code`` in a new interpreter with ``env``; its stdout words. It shares this process's kernel
    cache: the library keys each build by its source, flags, compiler and CPU, so a flag set is compiled
    once per test run (the portable and AVX2 builds here), not once per test."""
    env = dict(os.environ, **env)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_native_kernel_falls_back_cleanly_when_disabled():
    code = (
        "import torch\n"
        "from hf_sparsity.backends import get_backend\n"
        "b = get_backend('csr').from_dense(torch.eye(4))\n"
        "print(b.kernel)\n"
        "try:\n"
        "    get_backend('csr').from_dense(torch.eye(4), kernel='native')\n"
        "except Exception as e:\n"
        "    print(type(e).__name__)\n"
    )
    assert _run_fresh(code, HF_SPARSITY_NO_NATIVE="1") == ["torch", "SparsityError"]


@pytest.mark.slow  # builds the kernel with other flags, in a subprocess
@pytest.mark.skipif(not NATIVE, reason="native kernel did not build")
def test_native_kernel_portable_build_matches_emulator():
    # without -march=native the kernel takes its scalar path; same results
    code = (
        "import torch\n"
        "from hf_sparsity.backends import _native, get_backend\n"
        "from hf_sparsity import masks as M\n"
        "g = torch.Generator().manual_seed(0)\n"
        "w = torch.randn(37, 300, generator=g); m = (torch.rand(37, 300, generator=g) < "
        "0.2).to(torch.uint8)\n"
        "x = torch.randn(1, 300, generator=g)\n"
        "ref = get_backend('emulator').from_dense(w, m, float64_accumulator=True).linear(x)\n"
        "b = get_backend('csr').from_dense(w, m, kernel='native')\n"
        "torch.testing.assert_close(b.linear(x), ref, rtol=1e-5, atol=1e-5)\n"
        "b = get_backend('bitmask').from_dense(w, m, kernel='native')\n"
        "torch.testing.assert_close(b.linear(x), ref, rtol=1e-5, atol=1e-5)\n"
        "m = M.nm_mask(torch.rand(37, 300, generator=g), 2, 4, dim=1)\n"
        "ref = get_backend('emulator').from_dense(w, m, float64_accumulator=True).linear(x.repeat(3, 1))\n"
        "b = get_backend('nm24').from_dense(w, m, kernel='native')\n"
        "torch.testing.assert_close(b.linear(x.repeat(3, 1)), ref, rtol=1e-5, atol=1e-5)\n"
        "print(_native.simd())\n"
    )
    assert _run_fresh(code, HF_SPARSITY_NATIVE_ISA="scalar") == ["False"]


_POOL_CHECK = (
    "import os, torch\n"
    "maps = open('/proc/self/maps').read().split()\n"
    "torch_gomp = ','.join(sorted({os.path.basename(p) for p in maps if '/libgomp' in p})) or 'none'\n"
    "from hf_sparsity.backends import _native, get_backend\n"
    "from hf_sparsity import masks as M\n"
    "torch.set_num_threads(2)\n"
    "g = torch.Generator().manual_seed(0)\n"
    "w = torch.randn(300, 512, generator=g); m = (torch.rand(300, 512, generator=g) < 0.5).to(torch.uint8)\n"
    "for batch in (1, 3):\n"
    "    x = torch.randn(batch, 512, generator=g)\n"
    "    ref = get_backend('emulator').from_dense(w, m, float64_accumulator=True).linear(x)\n"
    "    for name in ('csr', 'bitmask', 'native_dense'):\n"
    "        b = get_backend(name).from_dense(w, m, kernel='native', threads=2)\n"
    "        for _ in range(3):\n"
    "            torch.testing.assert_close(b.linear(x), ref, rtol=1e-5, atol=1e-5)\n"
    "    nm = M.nm_mask(torch.rand(300, 512, generator=g), 2, 4, dim=1)\n"
    "    b = get_backend('nm24').from_dense(w, nm, kernel='native', threads=2)\n"
    "    r = get_backend('emulator').from_dense(w, nm, float64_accumulator=True).linear(x)\n"
    "    torch.testing.assert_close(b.linear(x), r, rtol=1e-5, atol=1e-5)\n"
    "maps = open('/proc/self/maps').read().split()\n"
    "print(_native.pool(), len({p for p in maps if '/libgomp' in p}), torch_gomp)\n"
)


@pytest.mark.slow  # a fresh interpreter
@pytest.mark.skipif(not NATIVE, reason="native kernel did not build")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_native_kernels_run_on_torchs_own_openmp_pool():
    # built with -fopenmp, the kernel library resolves libgomp.so.1 to the copy torch loaded: one OpenMP
    # runtime in the process, so the sparse layers' threads are torch's intra-op threads (two runtimes
    # would be two pools fighting for the same cores); two-thread results match the emulator
    pool, runtimes, torch_gomp = _run_fresh(_POOL_CHECK)
    if torch_gomp in ("libgomp.so.1", "none"):  # a torch whose libgomp our library resolves to (or none yet)
        assert pool == "openmp", "the kernel was not built with -fopenmp (is libgomp missing?)"
        assert runtimes == "1"
    else:  # torch ships a renamed libgomp: ours would be a second runtime, so the kernels use their own pool
        assert pool == "pthread"


@pytest.mark.slow  # a fresh interpreter
@pytest.mark.skipif(not NATIVE, reason="native kernel did not build")
def test_native_kernels_own_pthread_pool_still_matches_emulator():
    # the kernel's own pool (compilers without OpenMP; HF_SPARSITY_NATIVE_POOL=pthread) computes the same
    assert _run_fresh(_POOL_CHECK, HF_SPARSITY_NATIVE_POOL="pthread")[0] == "pthread"


def test_from_dense_rejects_bad_input():
    w = torch.randn(4, 8)
    with pytest.raises(SparsityError, match="does not match weight shape"):
        get_backend("csr").from_dense(w, torch.ones(8, 4, dtype=torch.uint8))
    with pytest.raises(SparsityError, match="2-D"):
        get_backend("csr").from_dense(torch.randn(4))
    with pytest.raises(SparsityError, match="unknown kernel"):
        get_backend("csr").from_dense(w, kernel="fast")
    with pytest.raises(SparsityError, match="native kernel"):
        get_backend("csr").from_dense(w.double(), kernel="native")
    with pytest.raises(SparsityError, match="expects 8"):
        get_backend("emulator").from_dense(w).linear(torch.randn(2, 5))


def test_check_nm_accepts_2_4_and_rejects_unstructured():
    score = torch.rand(8, 16)
    check_nm(M.nm_mask(score, 2, 4, dim=1), 2, 4)
    with pytest.raises(SparsityError, match='structure="2:4"'):
        check_nm(M.random_mask((8, 16), 0.5, 0, "x"), 2, 4)
    with pytest.raises(SparsityError, match="multiple of 4"):
        check_nm(torch.ones(8, 6, dtype=torch.uint8), 2, 4)


# ---------------------------------------------------------------------------- emulator
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("batch", [1, 5])
def test_emulator_counters_are_exact(level, batch):
    out_f, in_f = 37, 29
    w, mask, x, gy = _problem(batch, out_f, in_f, level, torch.float32)
    _, _, _, b = _run("emulator", w, mask, x, gy)
    nnz = int(mask.sum())
    assert b.nnz == nnz == out_f * in_f - M.num_zeros(level, out_f * in_f)
    for phase in ("forward", "backward_input", "backward_weight"):
        c = b.counters[phase]
        assert c.calls == 1
        assert c.macs == nnz * batch
        assert c.macs_skipped == (out_f * in_f - nnz) * batch
        assert c.weight_bytes == nnz * 4
        assert c.index_bytes == nnz * 2 + (out_f + 1) * 4
    b.linear(x)
    assert b.counters["forward"].macs == 2 * nnz * batch and b.counters["forward"].calls == 2
    b.reset_counters()
    assert b.counters["forward"].macs == 0


def test_emulator_follows_the_documented_order_exactly():
    """float64 accumulation equals a scalar loop: each row from 0, nonzeros in ascending column order."""
    w, mask, x, gy = _problem(3, 9, 11, 0.5, torch.float32)
    b = get_backend("emulator").from_dense(w, mask, float64_accumulator=True)
    y = b.linear(x.double()).numpy()
    wd, xd = w.double().numpy(), x.double().numpy()
    for bi in range(3):
        for r in range(9):
            acc = 0.0
            for c in range(11):
                if mask[r, c]:
                    acc = acc + wd[r, c] * xd[bi, c]
            assert y[bi, r] == acc
    # float32 accumulation, same order
    yf = get_backend("emulator").from_dense(w, mask).linear(x)
    for r in range(9):
        acc = torch.zeros((), dtype=torch.float32)
        for c in range(11):
            if mask[r, c]:
                acc = acc + w[r, c] * x[0, c]
        assert yf[0, r] == acc


def test_emulator_cycle_model():
    spec = MachineSpec(pes=4, axpy_width=8)
    out_f, in_f = 10, 16
    mask = torch.zeros(out_f, in_f, dtype=torch.uint8)
    mask[0, :] = 1  # all nonzeros on PE 0 -> load imbalance
    mask[5, :3] = 1
    w = torch.randn(out_f, in_f)
    b = get_backend("emulator").from_dense(w, mask, machine=spec)
    b.linear(torch.randn(9, in_f))  # 9 rows -> 2 AXPY cycles per nonzero
    c = b.counters["forward"]
    assert c.cycles == 16 * 2  # PE 0 owns rows 0, 4, 8: 16 nonzeros; PE 1 owns row 5: 3
    assert c.dense_cycles == math.ceil(out_f / 4) * in_f * 2
    assert b.modeled_speedup() == pytest.approx(c.dense_cycles / c.cycles)
    dense = get_backend("emulator").from_dense(w, torch.ones_like(mask), machine=spec)
    dense.linear(torch.randn(1, in_f))
    assert dense.modeled_speedup() == 1.0


def test_emulator_handles_gpt2_small_layers_in_seconds():
    t = time.perf_counter()
    for out_f, in_f in [(2304, 768), (768, 3072)]:
        w, mask, x, gy = _problem(8, out_f, in_f, 0.9, torch.float32)
        _run("emulator", w, mask, x, gy)
    assert time.perf_counter() - t < 20


def test_masked_dense_grad_is_masked_by_autograd():
    w, mask, x, gy = _problem(4, 16, 8, 0.75, torch.float32)
    _, _, gw, b = _run("masked_dense", w, mask, x, gy)
    assert torch.all(gw[mask == 0] == 0)
    assert b.counters["forward"].macs == int(mask.sum()) * 4


# ---------------------------------------------------------------------------- semi-structured (GPU)
@gpu
@pytest.mark.skipif(not CUDA, reason="no CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("batch,out_f,in_f", [(1, 768, 768), (64, 3072, 768), (13, 256, 512)])
def test_semi_structured_parity_gpu(dtype, batch, out_f, in_f):
    if not get_backend("semi_structured", check_available=False).is_available():
        pytest.skip("semi_structured unavailable on this GPU")
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(out_f, in_f, generator=g) / math.sqrt(in_f)).to(dtype)
    mask = M.nm_mask(w.abs(), 2, 4, dim=1)
    x = torch.randn(batch, in_f, generator=g).to(dtype)
    gy = torch.randn(batch, out_f, generator=g).to(dtype)
    y, gx, gw, _ = _run("semi_structured", w.cuda(), mask.cuda(), x.cuda(), gy.cuda())
    ry, rgx, rgw, _ = _reference(w, mask, x, gy)
    torch.testing.assert_close(y.cpu(), ry, **TOL[dtype])
    torch.testing.assert_close(gx.cpu(), rgx, **TOL[dtype])
    torch.testing.assert_close(gw.cpu(), rgw, **TOL[dtype])


# ---------------------------------------------------------------------------- CLI
def test_cli_bench_layer_json(capsys):
    from hf_sparsity.cli import main

    rc = main(["bench", "--backend", "csr", "--sparsity", "0.9", "--shape", "96x80", "--batch", "1",
               "--repeats", "3", "--json"])  # fmt: skip
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    for key in ("dense_ms", "backend_ms", "ratio", "max_abs_err"):
        assert key in res
    assert res["max_abs_err"] < 1e-5 and res["sparsity"] == pytest.approx(0.9, abs=1e-3)
    assert main(["bench", "--backend", "nope"]) == 2
    assert main(["bench", "--shape", "12by4"]) == 2
    assert "unknown sparse backend" in capsys.readouterr().err.lower()


# ---------------------------------------------------------------------------- packed CPU formats
PACKED_KERNELS = ["torch"] + (["native"] if NATIVE else [])


def _nm24_mask(out_f, in_f, g):
    """A 2:4 mask along the input dim where some groups keep fewer than two (padded slots)."""
    mask = M.nm_mask(torch.rand(out_f, in_f, generator=g), 2, 4, dim=1)
    drop = torch.rand(out_f, in_f, generator=g) < 0.2
    return mask * (~drop).to(torch.uint8)


@pytest.mark.parametrize("kernel", PACKED_KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["bitmask", "nm24", "native_dense"])
def test_packed_formats_match_the_emulator(name, dtype, kernel):
    # odd shapes (scalar tails), every batch path (1, the 4-row tiles, > SMALL_BATCH) with and without bias
    g = torch.Generator().manual_seed(11)
    shapes = [(1, 8), (33, 20), (24, 48), (40, 264)]
    for out_f, in_f in shapes:
        for level in (0.0, 0.5, 0.75, 0.97):
            if name == "nm24":
                if level:
                    continue
                mask = _nm24_mask(out_f, in_f, g)
            else:
                mask = (torch.rand(out_f, in_f, generator=g) >= level).to(torch.uint8)
            w = (torch.randn(out_f, in_f, generator=g) / math.sqrt(in_f)).to(dtype)
            emu = get_backend("emulator").from_dense(w.float(), mask, float64_accumulator=True)
            bias = torch.randn(out_f, generator=g).to(dtype)
            xs = torch.randn(35, in_f, generator=g).to(dtype)
            wants = emu.linear(xs.float(), bias.float()).split([1, 3, 4, 7, 20])
            for opts in ({}, {"prefill": "native"}):
                b = get_backend(name).from_dense(w, mask, kernel=kernel, **opts)
                assert b.kernel == kernel and b.dtype == dtype
                torch.testing.assert_close(b.to_dense(), (w.float() * mask).to(dtype), rtol=0, atol=0)
                for x, want in zip(xs.split([1, 3, 4, 7, 20]), wants):
                    batch = x.shape[0]
                    got = b.linear(x, bias)
                    assert got.dtype == dtype and got.shape == (batch, out_f)
                    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=3e-2)
                    torch.testing.assert_close(got.float(), want, **tol)


@pytest.mark.parametrize("name", ["bitmask", "nm24"])
def test_packed_formats_keep_no_dense_copy_and_reach_the_byte_bounds(name):
    g = torch.Generator().manual_seed(5)
    out_f, in_f = 256, 512
    mask = (
        M.nm_mask(torch.rand(out_f, in_f, generator=g), 2, 4, dim=1)
        if name == "nm24"
        else M.random_mask((out_f, in_f), 0.5, 0, "w")
    )
    w = torch.randn(out_f, in_f, generator=g)
    for dtype, bound in ((torch.float32, 2.125), (torch.bfloat16, 1.125)):
        b = get_backend(name).from_dense(w.to(dtype), mask)
        assert all(t.numel() < out_f * in_f for t in b._tensors()), "a dense-sized tensor is kept"
        assert not hasattr(b, "_tmp")
        per_weight = b.storage_bytes / (out_f * in_f)
        assert per_weight <= bound + 0.02, per_weight  # + row offsets and the 8-value pad
        assert torch.equal(b.mask, mask)
        torch.testing.assert_close(b.weight, (w * mask).to(dtype), rtol=0, atol=0)


def test_packed_formats_pass_gradients_to_x():
    w = torch.randn(16, 32)
    mask = M.random_mask((16, 32), 0.5, 0, "w")
    x = torch.randn(3, 32, requires_grad=True)
    y = get_backend("bitmask").from_dense(w, mask).linear(x)
    y.sum().backward()
    torch.testing.assert_close(x.grad, (w * mask).sum(0).expand(3, 32))


def test_packed_formats_refuse_bad_input_naming_alternatives():
    w = torch.randn(8, 16)
    with pytest.raises(SparsityError, match=r"bitmask.*float16.*(csr|masked_dense)"):
        get_backend("bitmask").from_dense(w.half())
    with pytest.raises(SparsityError, match=r"runs on cpu.*meta"):
        get_backend("nm24").from_dense(torch.empty(8, 16, device="meta"))
    with pytest.raises(SparsityError, match='structure="2:4"'):
        get_backend("nm24").from_dense(w, M.random_mask((8, 16), 0.5, 0, "w"))
    with pytest.raises(SparsityError, match="prefill"):
        get_backend("bitmask").from_dense(w, prefill="sometimes")
    with pytest.raises(SparsityError, match="no dense weight"):
        get_backend("bitmask").from_dense(w).refresh()


@pytest.mark.skipif(not NATIVE, reason="native kernel did not build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_f", [8, 40, 44, 296, 1544])
def test_native_unpack_matches_torch_and_reuses_its_buffer(in_f, dtype):
    # prefill's dense weight: the SIMD unpack kernels (bitmask, 2:4; in 44: a 2:4 scalar tail of four) give
    # exactly the masked weight, written into one buffer per shape and thread (no fresh pages per call)
    g = torch.Generator().manual_seed(in_f)
    w = torch.randn(37, in_f, generator=g).to(dtype)
    m = (torch.rand(37, in_f, generator=g) < 0.5).to(torch.uint8)
    m24 = M.nm_mask(torch.rand(37, in_f, generator=g), 2, 4, dim=1)
    m24[0, :4] = torch.tensor([0, 0, 1, 0], dtype=torch.uint8)  # groups keeping fewer than two
    m24[1, :4] = 0
    for name, mask in (("bitmask", m), ("nm24", m24)):
        want = w.float() * mask
        b = get_backend(name).from_dense(w, mask, kernel="native")
        assert torch.equal(b.to_dense().float(), want), name
        assert torch.equal(get_backend(name).from_dense(w, mask, kernel="torch").to_dense().float(), want)
        first = b.dense_for_matmul()
        assert torch.equal(first, want), name
        assert b.dense_for_matmul().data_ptr() == first.data_ptr()  # the same buffer, rewritten
        x = torch.randn(SMALL_BATCH + 24, in_f, generator=g).to(dtype)  # above SMALL_BATCH: unpack + GEMM
        torch.testing.assert_close(
            b.linear(x).float(), torch.nn.functional.linear(x.float(), want), rtol=2e-2, atol=2e-2
        )
    csr = get_backend("csr").from_dense(w.float(), m, kernel="native")
    assert torch.equal(csr.dense_for_matmul(), w.float() * m)


@pytest.mark.skipif(not NATIVE, reason="native kernel did not build")
@pytest.mark.parametrize("batch", [1, SMALL_BATCH + 24])
@pytest.mark.parametrize("name", ["bitmask", "nm24", "csr", "native_dense", "auto"])
def test_native_kernels_are_custom_ops_torch_compile_traces_without_graph_breaks(name, batch):
    from torch import nn

    from hf_sparsity.inference import SparseLinear

    g = torch.Generator().manual_seed(2)
    layers = []
    for _ in range(3):
        lin = nn.Linear(64, 64).eval()
        if name == "nm24":
            mask = M.nm_mask(torch.rand(64, 64, generator=g), 2, 4, dim=1)
        else:
            mask = (torch.rand(64, 64, generator=g) > 0.5).to(torch.uint8)
        opts = {"formats": ("bitmask",), "margin": -100.0, "rounds": 1} if name == "auto" else {}
        layers.append(SparseLinear(lin, get_backend(name).from_dense(lin.weight.detach(), mask, **opts)))
    mod = nn.Sequential(*layers)
    x = torch.randn(batch, 64, generator=g)  # batch > SMALL_BATCH: prefill (unpack + GEMM) under compile
    torch._dynamo.reset()
    with torch.no_grad():
        want = mod(x)
        got = torch.compile(mod, fullgraph=True, backend="aot_eager")(x)  # fullgraph: a break raises
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch._dynamo.reset()


@pytest.mark.skipif(not NATIVE, reason="native kernel did not build")
@pytest.mark.parametrize("name", ["bitmask", "csr", "auto"])
def test_bf16_layers_run_native_eager_and_compiled(name):
    # a bf16 model: the packed formats keep bf16 values, csr float32; both compute in float32 and return bf16,
    # eagerly and in a compiled graph without breaks, for decode and prefill batches
    from torch import nn

    from hf_sparsity.inference import SparseLinear

    g = torch.Generator().manual_seed(4)
    lin = nn.Linear(64, 48).eval().to(torch.bfloat16)
    mask = (torch.rand(48, 64, generator=g) > 0.5).to(torch.uint8)
    opts = {"formats": ("bitmask",), "margin": -100.0, "rounds": 1} if name == "auto" else {}
    mod = SparseLinear(lin, get_backend(name).from_dense(lin.weight.detach(), mask, **opts))
    for batch in (1, SMALL_BATCH + 24):
        x = torch.randn(batch, 64, generator=g).to(torch.bfloat16)
        want = x.float() @ (lin.weight.float() * mask).t() + lin.bias.float()
        torch._dynamo.reset()
        with torch.no_grad():
            eager = mod(x)
            compiled = torch.compile(mod, fullgraph=True, backend="aot_eager")(x)
        assert eager.dtype == compiled.dtype == torch.bfloat16
        torch.testing.assert_close(eager.float(), want, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(compiled, eager, rtol=1e-2, atol=1e-2)
    torch._dynamo.reset()


def _op_cases(batch: int) -> list[tuple[str, tuple, torch.Tensor]]:
    """``(op name, arguments, expected result)`` for the custom ops on one 40x64 layer."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 64, generator=g)
    m = (torch.rand(40, 64, generator=g) > 0.5).to(torch.uint8)
    nm = M.nm_mask(torch.rand(40, 64, generator=g), 2, 4, dim=1)
    x = torch.randn(batch, 64, generator=g)
    bias = torch.randn(40, generator=g)
    want = x @ (w * m).t() + bias
    bm = get_backend("bitmask").from_dense(w, m)
    b24 = get_backend("nm24").from_dense(w, nm)
    csr = get_backend("csr").from_dense(w, m, kernel="native")._native
    return [
        ("packed_linear", (x, bm.values, bm.bits, bm.rowptr, bias, "bitmask", 40, bm.nnz, 0), want),
        ("packed_linear", (x, b24.values, b24.meta, None, None, "nm24", 40, b24.nnz, 2), x @ (w * nm).t()),
        ("csr_linear", (x, csr.rowptr, csr.idx, csr.values, bias, 40, 0), want),
        ("packed_unpack", (bm.values, bm.bits, bm.rowptr, "bitmask_unpack", 40, 64, 0), w * m),
        ("csr_unpack", (csr.rowptr, csr.idx, csr.values, 40, 64), w * m),
    ]


@pytest.mark.skipif(not NATIVE, reason="native kernel did not build")
@pytest.mark.parametrize("batch", [1, 3])
def test_custom_ops_pass_torch_opcheck(batch):
    # the ops are defined with torch.library.Library (schema + CPU kernel + fake kernel); opcheck checks
    # the schema (no hidden mutation or aliasing) and that the fake kernel agrees with the real one
    from hf_sparsity.backends import _native

    for name, args, want in _op_cases(batch):
        op = getattr(torch.ops.hf_sparsity, name).default
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
        torch.testing.assert_close(op(*args), want, rtol=1e-5, atol=1e-5)
    assert _native.isa() in _native.ISA_NAMES and _native.pool() in ("openmp", "pthread")


@pytest.mark.skipif(not NATIVE, reason="native kernel did not build")
@pytest.mark.parametrize("name", ["bitmask", "nm24", "native_dense"])
def test_batch1_fast_path_refuses_misshaped_input_and_ignores_the_default_dtype(name):
    # the fast path takes one row of exactly in_features (a [2, 8] input to a 16-input layer has 16
    # elements too) and writes float32 whatever torch's default dtype is
    g = torch.Generator().manual_seed(6)
    w = torch.randn(8, 16, generator=g)
    m = M.nm_mask(torch.rand(8, 16, generator=g), 2, 4, dim=1)
    b = get_backend(name).from_dense(w, m, kernel="native")
    with torch.no_grad(), pytest.raises(SparsityError, match="features"):
        b.linear(torch.randn(2, 8, generator=g))
    x = torch.randn(1, 16, generator=g)
    old = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        with torch.no_grad():
            y = b.linear(x)
    finally:
        torch.set_default_dtype(old)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, x @ (w * m).t(), rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # builds the C++ ops (torch cpp_extension)
@pytest.mark.skipif(not NATIVE, reason="native kernel did not build")
@pytest.mark.skipif(
    not any(shutil.which(c) for c in (os.environ.get("CXX", "c++"), "g++", "clang++")),
    reason="no C++ compiler for torch.utils.cpp_extension",
)
@pytest.mark.parametrize("batch", [1, 3])
def test_cpp_custom_ops_build_pass_opcheck_and_match_the_python_ops(batch):
    # the C++ variants (hf_sparsity_cpp::) serve compiled graphs once built; the test extra installs ninja,
    # so a failed build fails here instead of silently leaving the slower Python ops
    from hf_sparsity.backends import ops

    assert ops.build_cpp_ops(), ops.cpp_ops_error()
    assert ops.linear_op("packed_linear") is torch.ops.hf_sparsity_cpp.packed_linear
    for name, args, want in _op_cases(batch):
        if "unpack" in name:  # prefill's unpack ops have no C++ variant
            continue
        op = getattr(torch.ops.hf_sparsity_cpp, name).default
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
        torch.testing.assert_close(op(*args), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(op(*args), getattr(torch.ops.hf_sparsity, name).default(*args))


@pytest.mark.skipif(not NATIVE, reason="native kernel did not build")
def test_cpp_custom_ops_can_be_switched_off():
    code = (
        "import torch\n"
        "from hf_sparsity.backends import ops\n"
        "print(ops.build_cpp_ops(), ops.linear_op('csr_linear') is torch.ops.hf_sparsity.csr_linear)\n"
        "print(ops.cpp_ops_error())\n"
    )
    assert _run_fresh(code, HF_SPARSITY_NO_CPP_OPS="1") == [
        "False",
        "True",
        "RuntimeError:",
        "HF_SPARSITY_NO_CPP_OPS=1",
    ]


@pytest.mark.slow  # builds the kernel with other flags, in a subprocess
@pytest.mark.skipif(not NATIVE, reason="native kernel did not build")
def test_native_kernels_avx2_build_matches_emulator():
    # on an AVX-512 CPU the bitmask kernel takes a 16-lane path; this checks the AVX2 one it would use
    # elsewhere, and the blocked batched kernel's 8-lane build (a batch of 40: prefill)
    code = (
        "import torch\n"
        "from hf_sparsity.backends import get_backend\n"
        "from hf_sparsity import masks as M\n"
        "g = torch.Generator().manual_seed(0)\n"
        "for in_f in (40, 296):\n"
        "    w = torch.randn(37, in_f, generator=g); m = (torch.rand(37, in_f, generator=g) < "
        "0.5).to(torch.uint8)\n"
        "    x = torch.randn(1, in_f, generator=g)\n"
        "    ref = get_backend('emulator').from_dense(w, m, float64_accumulator=True).linear(x)\n"
        "    for dt in (torch.float32, torch.bfloat16):\n"
        "        b = get_backend('bitmask').from_dense(w.to(dt), m, kernel='native')\n"
        "        r = get_backend('emulator').from_dense(w.to(dt).float(), m, "
        "float64_accumulator=True).linear(x)\n"
        "        torch.testing.assert_close(b.linear(x.to(dt)).float(), r, rtol=2e-2, atol=3e-2)\n"
        "    torch.testing.assert_close(get_backend('bitmask').from_dense(w, m).linear(x), ref, rtol=1e-5, "
        "atol=1e-5)\n"
        "    xb = torch.randn(40, in_f, generator=g)\n"
        "    got = get_backend('bitmask').from_dense(w, m, prefill='native').linear(xb)\n"
        "    want = xb.double() @ (w * m).t().double()\n"
        "    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)\n"
        "print('ok')\n"
    )
    assert _run_fresh(code, HF_SPARSITY_NATIVE_ISA="avx2") == ["ok"]


@pytest.mark.skipif(not NATIVE, reason="native kernel did not build")
@pytest.mark.parametrize("name", ["bitmask", "nm24", "native_dense"])
def test_batch1_fast_path_matches_with_bias_copies_and_thread_changes(name):
    # the decode fast path caches the kernel call's fixed arguments: a deep copy, a new thread count
    # and a bias must all still give the masked product, and the counters still count
    import copy

    g = torch.Generator().manual_seed(5)
    w = torch.randn(37, 576, generator=g)
    if name == "nm24":
        m = M.nm_mask(torch.rand(37, 576, generator=g), 2, 4, dim=1)
    else:
        m = (torch.rand(37, 576, generator=g) < 0.5).to(torch.uint8)
    b, bias, x = get_backend(name).from_dense(w, m), torch.randn(37, generator=g), torch.randn(1, 1, 576)
    want = torch.nn.functional.linear(x, w * m, bias)
    torch.testing.assert_close(b.linear(x, bias), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.linear(x), want - bias, rtol=1e-5, atol=1e-5)
    assert b.counters["forward"].calls == 2 and b.counters["forward"].macs == 2 * b.nnz
    copied = copy.deepcopy(b)
    del b
    torch.testing.assert_close(copied.linear(x, bias), want, rtol=1e-5, atol=1e-5)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.testing.assert_close(copied.linear(x, bias), want, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not NATIVE, reason="native kernel did not build")
def test_native_csr_copy_points_at_its_own_tensors():
    # no raw pointer outlives a copy: a deep copy keeps working after the original is freed
    import copy
    import gc

    g = torch.Generator().manual_seed(7)
    w = torch.randn(48, 96, generator=g)
    m = (torch.rand(48, 96, generator=g) < 0.1).to(torch.uint8)
    b = get_backend("csr").from_dense(w, m, kernel="native")
    x = torch.randn(1, 96, generator=g)
    copied = copy.deepcopy(b)
    assert copied._native.values.data_ptr() != b._native.values.data_ptr()
    del b
    gc.collect()
    torch.testing.assert_close(copied.linear(x), x @ (w * m).t(), rtol=1e-5, atol=1e-5)
