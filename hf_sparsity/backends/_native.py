"""The native CPU kernels (CSR, bitmask, 2:4, dense GEMV), compiled on first use and called via ctypes.

Decoding is memory-bound, so each format reads few bytes per weight and the kernels use every core:
CSR with float32 values and 16-bit column indices, the bitmask and 2:4 formats with fp32, bf16 or int8
values (:mod:`hf_sparsity.backends.formats`), rows handed to threads in contiguous chunks, the value
stream prefetched ahead in software (see the C source).

Threads: built with ``-fopenmp`` (the first flag set tried), the kernels run their row chunks on
OpenMP's team, and since this library is loaded after torch, its ``libgomp.so.1`` resolves to the copy
torch already loaded: the team is torch's own intra-op pool, whose threads (still spinning after the
last torch op) take the sparse layer's chunks instead of a second pool fighting them for the same
cores. A pool of the kernel's own is still built, for compilers without OpenMP or
``HF_SPARSITY_NATIVE_POOL=pthread``.

The source (``csrc/``, package data: ``hfs_kernels.c``, one translation unit that includes the pieces beside
it, one concern each) is plain C11 + pthreads + OpenMP (no torch headers), so it builds with the system C
compiler in a few seconds (``cc -O3 -march=native -shared -fopenmp``; ``HF_SPARSITY_NATIVE_ISA`` =
``native`` (default), ``avx2``, ``avx2-vnni`` or ``scalar`` picks the instruction set instead:
:data:`ISA_LEVELS`, :func:`isa`) into ``$HF_SPARSITY_CACHE`` (default ``~/.cache/hf_sparsity``), keyed by a
hash of every source file, the flags, compiler and CPU (one process compiles, others starting at once wait
on a lock file beside it), then loaded with ``ctypes`` (which releases the GIL during calls; callers on
other Python threads get OpenMP teams of their own, or, with the pthread pool, run serially rather than
share it). Anything failing (no compiler, read-only cache, non-Linux platform) makes :func:`load` return
``None`` and callers fall back to torch; ``HF_SPARSITY_NO_NATIVE=1`` forces that fallback.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading

import torch

from ..import_utils import c_compiler

try:
    import fcntl  # POSIX: the build lock
except ImportError:
    fcntl = None

logger = logging.getLogger(__name__)

SOURCE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
SOURCE_PATH = os.path.join(SOURCE_DIR, "hfs_kernels.c")  # the unit compiled; it includes the others
_SOURCE_SUFFIXES = (".c", ".h", ".cpp")  # as [tool.setuptools.package-data] ships them


def sources() -> dict[str, str]:
    """Every source file of ``backends/csrc/`` (shipped as package data), by name: ``hfs_kernels.c`` and
    the pieces it includes (the kernel cache key hashes all of them), and the C++ ops' source."""
    found = {}
    for name in sorted(os.listdir(SOURCE_DIR)):
        path = os.path.join(SOURCE_DIR, name)
        if name.endswith(_SOURCE_SUFFIXES) and os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                found[name] = f.read()
    return found


def source() -> str:
    """The kernels' C sources as one text: every file of :func:`sources`, each after a line naming it."""
    return "".join(f"/* ---- {name} */\n{text}" for name, text in sources().items())


_BASE_FLAGS = ["-O3", "-std=gnu11", "-shared", "-fPIC", "-pthread"]

ISA_ENV = "HF_SPARSITY_NATIVE_ISA"
# The instruction-set levels HF_SPARSITY_NATIVE_ISA picks: the compiler's target flags, and the CPU flags
# (/proc/cpuinfo) a level needs. "avx2" is x86-64-v3 (AVX2, FMA, F16C, BMI1/2, no AVX-512, no AVX-VNNI: an
# AMD Zen 2 / Zen 3 or Intel Haswell..Comet Lake); "avx2-vnni" adds AVX-VNNI's 256-bit int8 dot products
# (Intel Alder Lake and later, AMD Zen 5); "scalar": no target flags (the portable loops); "native": the
# build machine's own (-march=native: AVX-512 where it has it).
ISA_LEVELS = {
    "native": (["-march=native"], ()),
    "avx2": (["-march=x86-64-v3", "-mtune=native"], ("avx2", "fma", "f16c", "bmi2")),
    "avx2-vnni": (
        ["-march=x86-64-v3", "-mavxvnni", "-mtune=native"],
        ("avx2", "fma", "f16c", "bmi2", "avx_vnni"),
    ),
    "scalar": ([], ()),
}
# what the library was built for (the C source's hfs_isa)
ISA_NAMES = ("scalar", "avx2", "avx2-vnni", "avx512", "avx512-vnni")


def isa_level() -> str:
    """The level ``HF_SPARSITY_NATIVE_ISA`` asks for (default ``"native"``); a ``ValueError`` for an unknown
    level or one this CPU lacks."""
    level = os.environ.get(ISA_ENV, "") or "native"
    if level not in ISA_LEVELS:
        raise ValueError(f"{ISA_ENV}={level!r} is not a level: use one of {', '.join(ISA_LEVELS)}")
    needs = ISA_LEVELS[level][1]
    flags = set(_cpu_flags())
    missing = [f for f in needs if f not in flags]
    if flags and missing:  # flags unknown (no /proc/cpuinfo): the build itself tells
        raise ValueError(
            f"{ISA_ENV}={level}: this CPU lacks {', '.join(missing)}; use native or scalar (or unset it)"
        )
    return level


def _flag_sets(level: str, openmp: bool = True) -> tuple[list[str], ...]:
    """The flag sets tried in order: -fopenmp first (the kernels then run on torch's own OpenMP pool: see
    the C source's run_omp), then the pthread pool alone (a compiler without OpenMP); the level's target
    flags, then none (a compiler that cannot target them: the scalar loops)."""
    archs = [ISA_LEVELS[level][0]] + ([[]] if ISA_LEVELS[level][0] else [])
    omps = (["-fopenmp"], []) if openmp else ([],)
    return tuple([*_BASE_FLAGS[:1], *arch, *_BASE_FLAGS[1:], *omp] for arch in archs for omp in omps)


MIN_WORK_PER_THREAD = 16384  # multiply-adds; below this, waking a helper costs more than it saves


def chunk_rows(rows: int, nthreads: int) -> int:
    """Rows per chunk: one contiguous chunk per thread (still claimed dynamically, so a late thread's
    chunk is taken by the other). Long contiguous streams keep the hardware prefetcher going and cost
    one claim each; many small chunks were slower."""
    return max(1, -(-rows // max(1, nthreads)))


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_error: str | None = None


def cache_dir() -> str:
    """Where compiled kernels live: ``$HF_SPARSITY_CACHE/kernels`` or ``~/.cache/hf_sparsity/kernels``."""
    root = os.environ.get("HF_SPARSITY_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "hf_sparsity"
    )
    return os.path.join(root, "kernels")


def _cpu_id() -> str:
    """The CPU's model name and feature flags (a build for one must not load on a CPU lacking a flag)."""
    found: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                for field in ("model name", "flags"):
                    if line.startswith(field) and field not in found:
                        found[field] = line
                if len(found) == 2:
                    break
    except OSError:
        pass
    return "".join(found.values()) or platform.processor() or platform.machine()


def _cpu_flags() -> list[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (empty where it cannot be read)."""
    for line in _cpu_id().splitlines():
        if line.startswith("flags"):
            return line.partition(":")[2].split()
    return []


@contextlib.contextmanager
def _build_lock(out: str):
    """Held while ``out`` is compiled: processes starting at once (the ranks of a launcher, parallel test
    workers) build each library once, the others wait and load it. Without ``fcntl`` (not POSIX) no
    lock: each builds, and the atomic rename still keeps every library whole."""
    if fcntl is None:
        yield
        return
    with open(out + ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build(cc: str, openmp: bool = True) -> str:
    files = sources()
    code = "".join(f"{name}\0{text}\0" for name, text in files.items())
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    last = ""
    flag_sets = _flag_sets(isa_level(), openmp)
    for flags in flag_sets:
        key = hashlib.sha256("|".join([code, " ".join(flags), version, _cpu_id()]).encode()).hexdigest()[:16]
        out = os.path.join(cache_dir(), f"hfs_spmv_{key}.so")
        if os.path.isfile(out):
            return out
        os.makedirs(cache_dir(), exist_ok=True)
        with _build_lock(out), tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
            if os.path.isfile(out):  # built by another process while this one waited
                return out
            for name, text in files.items():  # the sources hashed, beside each other (the includes)
                with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                    f.write(text)
            src = os.path.join(tmp, os.path.basename(SOURCE_PATH))
            so = os.path.join(tmp, "hfs_spmv.so")
            proc = subprocess.run([cc, *flags, src, "-o", so], capture_output=True, text=True, timeout=120)
            if proc.returncode == 0:
                os.replace(so, out)  # atomic: concurrent builders race harmlessly
                return out
            last = proc.stderr.strip().splitlines()[-1:] or [""]
            last = f"{cc} {' '.join(flags)}: {last[0]}"
    raise RuntimeError(f"could not compile the native kernel ({last})")


def load() -> ctypes.CDLL | None:
    """The compiled kernel library (building it on first call), or ``None`` if unavailable."""
    global _lib, _tried, _error
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        level = isa_level()  # a bad HF_SPARSITY_NATIVE_ISA is the caller's to fix: raised, not a fallback
        cc = c_compiler()
        try:
            if cc is None:
                raise RuntimeError("no C compiler found (set $CC) or HF_SPARSITY_NO_NATIVE is set")
            before = _openmp_runtimes()
            try:
                lib = ctypes.CDLL(_build(cc))
            except OSError as e:  # e.g. a second libgomp that cannot be loaded (static TLS): no OpenMP
                logger.info(
                    "hf_sparsity: the OpenMP kernel build did not load (%s); using the pthread pool", e
                )
                lib = ctypes.CDLL(_build(cc, openmp=False))
            vp, i64, ci = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
            lib.hfs_matmul.argtypes = [ci, i64, i64, i64, ci, i64, i64, i64, i64, i64, i64, vp]
            lib.hfs_matmul.restype = None
            lib.hfs_run.argtypes = [ci, i64, i64, i64, ci, vp, vp, vp, ci, vp, vp, i64, vp]
            lib.hfs_run.restype = None
            lib.hfs_spmm.argtypes = [ci, i64, i64, ci, vp, vp, vp, ci, vp, vp, i64, vp]
            lib.hfs_spmm.restype = ci
            lib.hfs_run_prepared.argtypes, lib.hfs_run_prepared.restype = [vp, vp, vp, vp], None
            lib.hfs_set_spin.argtypes, lib.hfs_set_spin.restype = [i64], None
            lib.hfs_bm_gather.argtypes, lib.hfs_bm_gather.restype = [i64, i64, vp, vp, vp], i64
            lib.hfs_simd.argtypes, lib.hfs_simd.restype = [], ci
            lib.hfs_isa.argtypes, lib.hfs_isa.restype = [], ci
            lib.hfs_int8_dot.argtypes, lib.hfs_int8_dot.restype = [], ci
            lib.hfs_set_openmp.argtypes, lib.hfs_set_openmp.restype = [ci], ci
            lib.hfs_decode_step.argtypes, lib.hfs_decode_step.restype = [vp, i64, i64], i64
            lib.hfs_decode_step_greedy.argtypes, lib.hfs_decode_step_greedy.restype = [vp, i64, i64], i64
            lib.hfs_decode_step_top_k.argtypes = [vp, i64, i64, i64, ctypes.c_float, vp, i64]
            lib.hfs_decode_step_top_k.restype = i64
            lib.hfs_decode_prompt.argtypes, lib.hfs_decode_prompt.restype = [vp, vp, i64, i64], i64
            lib.hfs_decode_work_floats.argtypes, lib.hfs_decode_work_floats.restype = [vp], i64
            lib.hfs_sample.argtypes, lib.hfs_sample.restype = [vp, vp, vp, i64, ctypes.c_double, vp], i64
            if os.environ.get("HF_SPARSITY_NATIVE_POOL") == "pthread":
                lib.hfs_set_openmp(0)
            elif lib.hfs_set_openmp(-1) and len(_openmp_runtimes() | before) > max(1, len(before)):
                # torch ships a libgomp under another name (some wheels rename it): ours is a second
                # runtime, whose threads would fight torch's; the kernel's own pool does better then
                logger.info("hf_sparsity: torch's OpenMP runtime is not shared; using the pthread pool")
                lib.hfs_set_openmp(0)
            if level != "scalar" and not lib.hfs_simd():
                logger.warning(
                    "hf_sparsity: the native kernels run their scalar loops (%s=%s: the CPU or the compiler "
                    "has no AVX2 + FMA)", ISA_ENV, level,
                )  # fmt: skip
            _lib = lib
        except Exception as e:  # any failure means: fall back to torch.sparse
            _error = str(e)
            logger.info("Native CSR kernel unavailable, using torch.sparse CSR instead: %s", e)
            _lib = None
        _tried = True
    return _lib


def _openmp_runtimes() -> set[str]:
    """The OpenMP runtime files (libgomp / libiomp / libomp) mapped into this process (Linux)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            paths = {line.split()[-1] for line in f if "/lib" in line}
    except OSError:
        return set()
    return {p for p in paths if os.path.basename(p).startswith(("libgomp", "libiomp", "libomp"))}


def simd() -> bool:
    """Whether the loaded kernel uses the AVX2/FMA batch-1 path (False: scalar fallback or no kernel)."""
    lib = load()
    return bool(lib is not None and lib.hfs_simd())


def build_id() -> str:
    """Which kernel build is loaded: its file's name, whose hash covers the sources, the compiler flags (the
    instruction-set level), the compiler and the CPU (``"none"`` without a native kernel). Measured plans
    hold for one build only: the same layer can be faster as bitmask at one level and dense at another."""
    lib = load()
    return "none" if lib is None else os.path.splitext(os.path.basename(lib._name))[0]


def isa() -> str | None:
    """The instruction set the kernels were built for: ``"avx512-vnni"``, ``"avx512"``, ``"avx2-vnni"`` (AVX2
    with AVX-VNNI), ``"avx2"`` (with FMA), ``"scalar"``, or ``None`` (no kernel). ``HF_SPARSITY_NATIVE_ISA``
    (:data:`ISA_LEVELS`) picks the level built."""
    lib = load()
    return None if lib is None else ISA_NAMES[lib.hfs_isa()]


def int8_dot() -> str | None:
    """How batch-1 products with int8 values and int8 activations multiply: ``"vnni"`` (AVX-512 VNNI, every
    format), ``"vnni-dense"`` (AVX-512 VNNI for the dense GEMV, 256-bit vpdpbusd for bitmask / 2:4: no VBMI2
    byte expand), ``"avx-vnni"`` (256-bit vpdpbusd), ``"avx2"`` (vpmaddubsw + vpmaddwd), ``"float"`` (the
    scalar build: the dequantized activations on the float kernels), or ``None`` (no kernel)."""
    lib = load()
    return None if lib is None else ("float", "avx2", "avx-vnni", "vnni-dense", "vnni")[lib.hfs_int8_dot()]


def pool() -> str | None:
    """Where the kernels' threads come from: ``"openmp"`` (torch's own intra-op pool: the library is
    built with ``-fopenmp`` and shares the libgomp torch loaded), ``"pthread"`` (the kernel's own pool:
    no OpenMP in the compiler, or ``HF_SPARSITY_NATIVE_POOL=pthread``), or ``None`` (no kernel)."""
    lib = load()
    if lib is None:
        return None
    return "openmp" if lib.hfs_set_openmp(-1) else "pthread"


def error() -> str | None:
    """Why :func:`load` returned ``None`` (after it was called)."""
    return _error


class NativeCSR:
    """float32 CSR with 16-bit (or 32-bit) column indices and int64 row pointers, on CPU."""

    def __init__(self, rowptr: torch.Tensor, cols: torch.Tensor, values: torch.Tensor, shape):
        if load() is None:
            raise RuntimeError(f"native kernel unavailable: {_error}")
        self.rows, self.cols_n = int(shape[0]), int(shape[1])
        self.rowptr = rowptr.to(torch.int64).contiguous()
        if self.cols_n <= 65536:
            # Column indices < 65536 fit uint16; torch has no uint16 arithmetic, so store the bit pattern as
            # int16.
            self.idx = cols.to(torch.int32).to(torch.int16).contiguous()
        else:
            self.idx = cols.to(torch.int32).contiguous()
        self.values = values.to(torch.float32).contiguous()
        self.nnz = int(self.values.numel())

    @property
    def index_bytes(self) -> int:
        return self.idx.numel() * self.idx.element_size() + self.rowptr.numel() * 8

    def matmul(
        self, x2d: torch.Tensor, nthreads: int | None = None, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x2d @ W^T (+ bias)`` for ``x2d`` of shape ``[B, in]``; returns ``[B, out]`` float32."""
        if x2d.dtype != torch.float32:
            x2d = x2d.float()
        nt = threads_for(self.nnz * x2d.shape[0], nthreads)
        return csr_matmul(self.rowptr, self.idx, self.values, self.rows, x2d, nt, bias)


def csr_matmul(
    rowptr: torch.Tensor,
    idx: torch.Tensor,
    values: torch.Tensor,
    rows: int,
    x2d: torch.Tensor,
    nthreads: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x2d @ W^T (+ bias)`` for a CSR weight (int64 ``rowptr``, int16 / int32 column indices, float32
    values) and float32 ``x2d`` ``[B, in]``; returns ``[B, rows]`` float32. Batches of 17 rows or more go
    through the blocked kernel (the C source's ``hfs_spmm``)."""
    batch, in_f = x2d.shape
    y = torch.empty(batch, rows, dtype=torch.float32)
    if batch == 0 or rows == 0:
        return y if bias is None else y.copy_(bias.float().expand_as(y))
    x2d = x2d.contiguous()
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    load().hfs_matmul(
        0 if idx.dtype == torch.int16 else 1, rows, in_f, chunk_rows(rows, nthreads), nthreads,
        rowptr.data_ptr(), idx.data_ptr(), values.data_ptr(), x2d.data_ptr(), y.data_ptr(), batch,
        None if bias is None else bias.data_ptr(),
    )  # fmt: skip
    return y


class Prepared(ctypes.Structure):
    """The fixed arguments of a batch-1 :func:`run_op` call (``hfs_run_prepared`` in the C source; the
    struct ``prepared_t`` in ``csrc/api.h``, checked field by field by ``tests/test_struct_mirrors.py``)."""

    _fields_ = [
        ("op", ctypes.c_int64), ("rows", ctypes.c_int64), ("in_features", ctypes.c_int64),
        ("chunk", ctypes.c_int64), ("nthreads", ctypes.c_int64), ("rowptr", ctypes.c_void_p),
        ("meta", ctypes.c_void_p), ("values", ctypes.c_void_p), ("vbf16", ctypes.c_int64),
    ]  # fmt: skip


_PREPARED: dict[tuple, tuple] = {}
"""Prepared batch-1 calls (the eager fast path and the custom ops), keyed by every argument they hold:
a hit is the call the general path would make, whatever tensor object is passed."""


def prepared_call(key: tuple) -> tuple:
    """``(Prepared, its address)`` for ``key`` = ``(op, rows, in_features, nthreads, rowptr, meta, values,
    vbf16)`` (pointers as ints), built on first use. The caller holds the returned structure until its
    kernel call returns: another thread may evict the cache entry meanwhile (the cache starts over past
    4096 entries)."""
    hit = _PREPARED.get(key)
    if hit is None:
        if len(_PREPARED) > 4096:
            _PREPARED.clear()
        op, rows, in_f, nt, rowptr, meta, values, bf16 = key
        prep = Prepared(op, rows, in_f, chunk_rows(rows, nt), nt, rowptr, meta, values, bf16)
        hit = _PREPARED.setdefault(key, (prep, ctypes.addressof(prep)))
    return hit


def decode_row(x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """One contiguous float32 row (and a float32 contiguous bias or none): the prepared-call path."""
    return (
        x.numel() == x.shape[-1]
        and x.dtype == torch.float32
        and x.is_contiguous()
        and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
    )


def vtype(values: torch.Tensor) -> int:
    """The kernels' value type of a values tensor: 0 float32, 1 bfloat16, 2 int8 (a buffer that starts with
    the rows' float32 scales, see :func:`scale_bytes`). Value type 3, int8 values whose products quantize
    their input too (``formats.quantize_activations``), is the int8 backends' batch-1 call."""
    return 2 if values.dtype == torch.int8 else int(values.dtype == torch.bfloat16)


def scale_bytes(rows: int) -> int:
    """Bytes of the per-row float32 scales at the start of an int8 values buffer (padded to 64)."""
    return (rows * 4 + 63) & ~63


OPS = {"bitmask": 0, "nm24": 1, "gemv": 2, "bitmask_unpack": 3, "nm24_unpack": 4, "bitmask_gather": 5}
UNPACK_OPS = ("bitmask_unpack", "nm24_unpack")


def threads_for(work: int, nthreads: int | None = None) -> int:
    """Threads for a product of ``work`` multiply-adds: ``nthreads`` if given, else as many of
    ``torch.get_num_threads()`` as keep at least :data:`MIN_WORK_PER_THREAD` each (at least 1)."""
    if nthreads:
        return max(1, int(nthreads))
    return max(1, min(torch.get_num_threads(), work // MIN_WORK_PER_THREAD))


def run_op(
    op: str,
    rows: int,
    in_features: int,
    x2d: torch.Tensor,
    values: torch.Tensor,
    meta: torch.Tensor | None = None,
    rowptr: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    nthreads: int = 1,
    chunk: int | None = None,
    out: torch.Tensor | None = None,
    int8_activations: bool = False,
) -> torch.Tensor:
    """``x2d @ W^T (+ bias)`` (or, for the ``*_unpack`` ops, the dense ``[rows, in]`` weight) with a packed
    weight; ``x2d`` float32 ``[B, in]`` contiguous; ``values`` float32, bfloat16 (read as its bits) or an
    int8 buffer (per-row float32 scales, then the int8 values; see :func:`scale_bytes`).
    ``out``: for the unpack ops, a contiguous float32 ``[rows, in]`` tensor to write into (a reused
    buffer: no fresh pages to fault in). ``int8_activations`` (int8 ``values``): the kernel quantizes ``x2d``
    itself, as :func:`~hf_sparsity.backends.formats.quantize_activations` does."""
    lib = load()
    if lib is None:
        raise RuntimeError(f"native kernel unavailable: {_error}")
    if op in UNPACK_OPS:
        if out is not None:
            if out.shape != (rows, in_features) or out.dtype != torch.float32 or not out.is_contiguous():
                raise ValueError(f"out must be a contiguous float32 [{rows}, {in_features}] tensor")
            y = out
        else:
            y = torch.empty(rows, in_features, dtype=torch.float32)
        batch = 1
    else:
        batch = x2d.shape[0]
        y = torch.empty(batch, rows, dtype=torch.float32)
    if rows == 0 or batch == 0:
        return y if bias is None else y.copy_(bias.float().expand_as(y))
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    chunk = chunk or chunk_rows(rows, nthreads)
    lib.hfs_run(
        OPS[op], rows, in_features, chunk, nthreads,
        None if rowptr is None else rowptr.data_ptr(),
        None if meta is None else meta.data_ptr(),
        values.data_ptr(), 3 if int8_activations and op not in UNPACK_OPS else vtype(values),
        None if x2d is None else x2d.data_ptr(), y.data_ptr(), batch,
        None if bias is None else bias.data_ptr(),
    )  # fmt: skip
    return y


def csr_unpack_into(out: torch.Tensor, rowptr: torch.Tensor, idx: torch.Tensor, values: torch.Tensor):
    """Write the dense float32 weight of a :class:`NativeCSR` (int64 rowptr, int16 / int32 column
    indices, float32 values) into ``out`` ``[rows, cols]`` and return it."""
    rows = torch.repeat_interleave(torch.arange(out.shape[0]), rowptr.diff())
    cols = idx.to(torch.int64) & 0xFFFF if idx.dtype == torch.int16 else idx.to(torch.int64)
    out.zero_()
    out[rows, cols] = values.to(out.dtype)
    return out
