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
sums would saturate. ``bitmask-gather`` is the bitmask format with its batch-1 product on the gathered layout
(``layout="gather"``, forced at every level), on masks of mixed density (empty rows, full runs, sparse rows).
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
from hf_sparsity.utils import SparsityError

NATIVE = _native.load() is not None
pytestmark = pytest.mark.skipif(not NATIVE, reason="native kernel did not build (no C compiler)")

WIDTHS = range(1, 131)
# another level's sweep (a subprocess per part): every width up to 70 (each tail of the 8-, 16-, 32- and
# 64-column blocks, one and two blocks) and 127-130 (two 64-column blocks and their tails)
ISA_WIDTHS = (*range(1, 71), 127, 128, 129, 130)
OUT_WIDTHS = (1, 7, 13)
BATCHES = {"decode": 1, "rows": 5, "blocked": 19}

# (format, value type): every combination a native kernel serves
KERNELS = [
    ("csr", "fp32"),
    ("bitmask", "fp32"),
    ("bitmask", "bf16"),
    ("bitmask", "int8"),
    ("bitmask", "int8-float-act"),
    ("bitmask-gather", "fp32"),
    ("bitmask-gather", "bf16"),
    ("bitmask-gather", "int8-float-act"),
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
    if name == "bitmask-gather":  # rows of density 0 .. 1: chunks of every count, full windows, empty rows
        density = torch.tensor([0.0, 0.1, 0.3, 0.5, 0.8, 1.0, 0.2])[torch.arange(out_f) % 7]
        return (torch.rand(out_f, in_f, generator=g) < density[:, None]).to(torch.uint8)
    if name == "bitmask":  # rows of density 0 .. 1 (empty and full 16- and 64-column steps), varied by width
        density = torch.tensor([0.5, 0.0, 1.0, 0.3, 0.8, 0.1, 0.5])[(torch.arange(out_f) + in_f) % 7]
        return (torch.rand(out_f, in_f, generator=g) < density[:, None]).to(torch.uint8)
    return (torch.rand(out_f, in_f, generator=g) < 0.5).to(torch.uint8)


def sweep(name: str, vtype: str, widths=WIDTHS) -> int:
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
    if name.startswith("bitmask"):  # the mask kernels, or the gathered layout, at every level
        opts["layout"] = "gather" if name == "bitmask-gather" else "mask"
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=3e-2)
    splits = [BATCHES[p] for p in BATCHES]
    checked = 0
    for in_f in widths:
        if name == "nm24" and in_f % 4:
            continue
        for out_f in OUT_WIDTHS:
            w = (torch.randn(out_f, in_f, generator=g) / math.sqrt(in_f)).to(dtype)
            mask = _mask(name, out_f, in_f, g)
            b = get_backend(name.partition("-")[0]).from_dense(w, mask, **opts)
            if name == "bitmask-gather":  # the batch-1 path runs on the gathered layout wherever it applies
                assert (b.gather is not None) == (in_f >= 16 and vtype != "int8")
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


@pytest.mark.parametrize("vtype", ["fp32", "bf16", "int8"])
def test_bitmask_batch1_long_rows_split_over_threads(vtype):
    """The batch-1 bitmask kernels over the decoding step's row lengths (many 64-column steps, a 32- and a
    16-column tail) and row counts no step of rows divides, split over two threads (a chunk starting
    mid-weight), rows of density 0, 1 and between: against the float64 sum of the kept weights times x (int8:
    of the codes' dequantized weight and activations, the definition of value type 3)."""
    g = torch.Generator().manual_seed(29)
    for rows, in_f in [(151, 576), (89, 1000), (59, 1536)]:
        w = torch.randn(rows, in_f, generator=g)
        density = torch.tensor([0.0, 1.0, 0.25, 0.5, 0.75, 0.3])[torch.arange(rows) % 6]
        mask = (torch.rand(rows, in_f, generator=g) < density[:, None]).to(torch.uint8)
        opts = {"values": "int8"} if vtype == "int8" else {}
        if vtype == "bf16":
            w = w.bfloat16()
        b = get_backend("bitmask").from_dense(w, mask, kernel="native", threads=2, layout="mask", **opts)
        assert b._threads(1) == 2  # two chunks of rows
        x = torch.randn(1, in_f, generator=g)
        if vtype == "int8":
            wd, xd = b._unpack().double(), quantize_activations(x).double()
        else:
            wd, xd = (w.double() * mask), x.bfloat16().double() if vtype == "bf16" else x.double()
        want = xd @ wd.T
        got = b.linear(x.bfloat16() if vtype == "bf16" else x).double()
        tol = dict(rtol=2e-2, atol=3e-2) if vtype == "bf16" else dict(rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(got, want, **tol, msg=lambda m, s=f"{rows}x{in_f}": f"{s}: {m}")
        assert torch.equal(got[0, 0], torch.zeros((), dtype=torch.float64))  # the empty row


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
        which = [k for k in which if k[0].startswith(("csr", "bitmask")) == (kernels == "csr-bitmask")]
    split = {"int8": ["int8"], "csr-bitmask": ["fp32", "bf16"]}.get(kernels, [])
    code = (
        f"import sys; sys.path.insert(0, {root!r})\n"
        "from tests import test_native_kernels as t\n"
        "from hf_sparsity.backends import _native\n"
        "got = (_native.isa(), _native.int8_dot())\n"
        f"assert got == ({isa!r}, {dot!r}), got\n"
        f"for n, v in {which!r}:\n"
        "    t.sweep(n, v, t.ISA_WIDTHS)\n"
        f"for v in {split!r}:\n"  # chunks of rows starting mid-weight (the sweep runs one thread)
        "    t.test_bitmask_batch1_long_rows_split_over_threads(v)\n"
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


# the decoding step's work between the products (exp, SiLU, attention, argmax: 256-bit vectors on AVX2, the
# scalar loops) at those levels: its own tests there, and greedy / sampled decoding against transformers
STEP_PARTS = {
    "vectors": [
        "tests/test_native_step_vectors.py",
        "tests/test_native_sampling.py::test_the_native_steps_argmax_is_torchs_on_ties_and_nans",
        "tests/test_native_sampling.py::test_greedy_gives_generates_tokens_on_ties_and_nans",
    ],
    "greedy-llama": ["tests/test_native_generate.py::test_greedy_is_token_identical_to_generate"],
    "greedy-gpt2": ["tests/test_native_generate.py::test_gpt2_greedy_is_token_identical_to_generate"],
    "sampling": ["tests/test_native_generate.py::test_sampling_draws_from_generates_processed_probabilities"],
}


STEP_CASES = [  # every part at the AVX2 level, the step's own tests at the scalar level
    *(pytest.param(part, *LEVELS[0].values, marks=LEVELS[0].marks, id=f"{part}-avx2") for part in STEP_PARTS),
    pytest.param("vectors", *LEVELS[2].values, id="vectors-scalar"),
]


@pytest.mark.slow  # the decoding tests again at another level, in a subprocess
@pytest.mark.parametrize("part,level,isa,dot", STEP_CASES)
def test_decode_step_at_the_avx2_and_scalar_levels(part, level, isa, dot):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", *STEP_PARTS[part]]
    code = f"from hf_sparsity.backends import _native; assert _native.isa() == {isa!r}, _native.isa()"
    env = {**os.environ, _native.ISA_ENV: level}
    assert subprocess.run([sys.executable, "-c", code], cwd=root, env=env, timeout=300).returncode == 0
    proc = subprocess.run(args, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    tail = proc.stdout.strip().splitlines()[-1:]
    assert proc.returncode == 0 and tail and " passed" in tail[0] and "skipped" not in tail[0], proc.stdout[
        -3000:
    ]


# ------------------------------------------------------------------ the gathered bitmask layout (op 5)
def _greedy_chunks(mask: torch.Tensor) -> list[list[tuple[int, list[int]]]]:
    """Per row, the definition of the gathered layout's chunks: from the next kept column c, the kept columns
    of the sixteen from base = min(c, in - 16), at most eight; as (base, columns)."""
    in_f = mask.shape[1]
    rows = []
    for row in mask.tolist():
        kept, chunks, i = [c for c, k in enumerate(row) if k], [], 0
        while i < len(kept):
            base = min(kept[i], in_f - 16)
            cols = [c for c in kept[i:] if c < base + 16][:8]
            chunks.append((base, cols))
            i += len(cols)
        rows.append(chunks)
    return rows


def _decode_chunks(gather: torch.Tensor, rows: int) -> list[list[tuple[int, list[int]]]]:
    cp = gather[: rows + 1].tolist()
    words = [c & (2**64 - 1) for c in gather[rows + 1 :].tolist()]  # the uint64 bit patterns
    out = []
    for r in range(rows):
        row = []
        for c in words[cp[r] : cp[r + 1]]:
            base, n = (c >> 32) & 0xFFFFFF, c >> 56
            row.append((base, [base + ((c >> (4 * i)) & 15) for i in range(n)]))
        out.append(row)
    return out


def test_gathered_layout_is_the_greedy_chunking_of_the_mask():
    g = torch.Generator().manual_seed(5)
    for in_f in (16, 17, 40, 129):
        mask = _mask("bitmask-gather", 14, in_f, g)
        mask[2, -3:] = 1  # kept columns in the last window: its base clamped to in - 16
        b = get_backend("bitmask").from_dense(torch.randn(14, in_f, generator=g), mask, layout="gather")
        assert _decode_chunks(b.gather, 14) == _greedy_chunks(mask)
        assert b.storage_bytes == sum(t.numel() * t.element_size() for t in b.storage_tensors()) + 8 * (
            b.gather.numel()
        )  # the layout's memory is counted, its tensor is not saved
    narrow = get_backend("bitmask").from_dense(torch.randn(3, 15), torch.ones(3, 15), layout="gather")
    assert narrow.gather is None  # fewer than 16 columns: the bitmask kernel


def test_gathered_layout_is_chosen_on_avx2_builds_where_it_pays(monkeypatch):
    g = torch.Generator().manual_seed(6)
    w = torch.randn(64, 576, generator=g)
    sparse = (torch.rand(64, 576, generator=g) < 0.3).to(
        torch.uint8
    )  # 70% sparse: ~0.45 chunks per mask byte
    half = (torch.rand(64, 576, generator=g) < 0.5).to(torch.uint8)  # 50%: ~0.53, no faster than the mask

    def make(mask, **opts):
        return get_backend("bitmask").from_dense(w, mask, kernel="native", **opts)

    for isa in ("avx512-vnni", "avx512", "scalar"):  # other builds keep the bitmask kernel
        monkeypatch.setattr(_native, "isa", lambda isa=isa: isa)
        assert make(sparse).gather is None
    for isa in ("avx2", "avx2-vnni"):
        monkeypatch.setattr(_native, "isa", lambda isa=isa: isa)
        b = make(sparse)
        assert b.gather is not None and b._batch1_call()[0].op == _native.OPS["bitmask_gather"]
        assert make(half).gather is None and make(half)._batch1_call()[0].op == _native.OPS["bitmask"]
        assert make(sparse, layout="mask").gather is None
        assert make(sparse, values="int8").gather is None  # int8 activations: the int8 x int8 kernels
        assert make(sparse, values="int8", activations="float32").gather is not None
        assert make(half, layout="gather").gather is not None  # forced
        assert get_backend("bitmask").from_dense(w, sparse, kernel="torch").gather is None
    with pytest.raises(SparsityError, match="layout must be one of auto, mask, gather"):
        make(sparse, layout="chunks")


def test_gathered_layout_survives_copies_and_runs_in_fused_calls():
    import copy
    import ctypes
    import pickle

    g = torch.Generator().manual_seed(7)
    w1, w2 = torch.randn(40, 96, generator=g), torch.randn(24, 96, generator=g)
    m1 = (torch.rand(40, 96, generator=g) < 0.3).to(torch.uint8)
    m2 = (torch.rand(24, 96, generator=g) < 0.3).to(torch.uint8)
    b1 = get_backend("bitmask").from_dense(w1, m1, kernel="native", layout="gather")
    b2 = get_backend("bitmask").from_dense(w2, m2, kernel="native", layout="mask")
    x, bias = torch.randn(1, 96, generator=g), torch.randn(40, generator=g)
    want = (x.double() @ (w1 * m1).double().t() + bias.double()).float()
    torch.testing.assert_close(b1.linear(x, bias), want, rtol=1e-5, atol=1e-5)
    for c in (copy.deepcopy(b1), pickle.loads(pickle.dumps(b1))):
        assert torch.equal(c.gather, b1.gather) and c.gather.data_ptr() != b1.gather.data_ptr()
        torch.testing.assert_close(c.linear(x, bias), want, rtol=1e-5, atol=1e-5)
    # the decoding step's fused call (hfs_run_fused: one hand-off for products of one input) takes op 5
    lib, vp = _native.load(), ctypes.c_void_p
    lib.hfs_run_fused.argtypes, lib.hfs_run_fused.restype = [vp, ctypes.c_int, vp, vp, vp], None
    preps = [b._batch1_call()[1] for b in (b1, b2)]
    assert [b._batch1_call()[0].op for b in (b1, b2)] == [5, 0]
    y1, y2 = torch.full((1, 40), float("nan")), torch.full((1, 24), float("nan"))
    lib.hfs_run_fused(
        (vp * 2)(*preps),
        2,
        x.data_ptr(),
        (vp * 2)(y1.data_ptr(), y2.data_ptr()),
        (vp * 2)(bias.data_ptr(), None),
    )
    torch.testing.assert_close(y1, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y2, (x.double() @ (w2 * m2).double().t()).float(), rtol=1e-5, atol=1e-5)


def test_native_decode_step_on_the_gathered_layout():
    from hf_sparsity.inference import sparsify_for_inference
    from hf_sparsity.inference.decoding import greedy_decode, native_step_reason

    from .realistic import generate_greedy, prompt, realistic_model

    model = realistic_model("llama", heads=4, kv_heads=2, attention_bias=True, mlp_bias=True)
    g = torch.Generator().manual_seed(8)
    masks = {
        f"{n}.weight": (torch.rand(mod.weight.shape, generator=g) < 0.3).to(torch.uint8)
        for n, mod in model.named_modules()
        if isinstance(mod, torch.nn.Linear) and n != "lm_head"
    }
    sparsify_for_inference(model, "bitmask", masks=masks, layout="gather")
    layers = [m.backend for m in model.modules() if hasattr(m, "backend")]
    assert layers and all(b.gather is not None for b in layers)
    assert native_step_reason(model) is None
    ids = prompt(6, model.config.vocab_size, seed=3)
    want = generate_greedy(model, ids, 12)
    assert torch.equal(greedy_decode(model, ids, 12, eos_token_id=[], step="native"), want)
