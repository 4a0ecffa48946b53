"""A small native CSR kernel for batch-1 decoding on CPU, compiled on first use.

Why: torch.sparse CSR reaches only ~1.2x dense at 90% sparsity for a batch-1
matvec on CPU. Decoding is memory-bound, so the format must read few bytes per
nonzero and the kernel must use every core: float32 values with 16-bit column
indices (6 bytes per nonzero instead of 4 bytes per dense weight, or 12 for int64
CSR), rows handed to threads in contiguous chunks, dynamically (robust to a preempted thread).

The source is plain C11 + OpenMP (no torch headers), so it builds with the system
C compiler in well under a second (``cc -O3 -march=native -fopenmp -shared``) into
``$HF_SPARSITY_CACHE`` (default ``~/.cache/hf_sparsity``), keyed by a hash of the
source, flags, compiler and CPU, then loaded with ``ctypes`` (which releases the
GIL during calls). The OpenMP runtime it binds to is the ``libgomp.so.1`` torch
has already loaded, so both share one thread pool. Anything failing (no compiler,
sandboxed cache, odd platform) makes :func:`load` return ``None`` and callers fall
back to torch.sparse; ``HF_SPARSITY_NO_NATIVE=1`` forces that fallback.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading

import torch

logger = logging.getLogger(__name__)

SOURCE = r"""
#include <stdint.h>
#include <string.h>

/* y[r] = sum_j v[j] * x[idx[j]]. Rows go to threads in chunks of `chunk` contiguous rows,
   handed out dynamically: a thread the OS preempts (2 shared cores) holds up at most one chunk.
   Four accumulators hide the FMA latency; rows are independent so threads never share output. */
#define SPMV(NAME, ITYPE)                                                                  \
void NAME(int64_t rows, int64_t chunk, int nthreads, const int64_t* rowptr,                \
          const ITYPE* idx, const float* v, const float* x, float* y) {                   \
  _Pragma("omp parallel for schedule(dynamic, 1) num_threads(nthreads)")                   \
  for (int64_t c0 = 0; c0 < rows; c0 += chunk) {                                           \
    int64_t c1 = c0 + chunk < rows ? c0 + chunk : rows;                                    \
    for (int64_t r = c0; r < c1; r++) {                                                    \
      int64_t j = rowptr[r], e = rowptr[r + 1];                                            \
      float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;                                        \
      for (; j + 4 <= e; j += 4) {                                                         \
        a0 += v[j] * x[idx[j]];         a1 += v[j + 1] * x[idx[j + 1]];                    \
        a2 += v[j + 2] * x[idx[j + 2]]; a3 += v[j + 3] * x[idx[j + 3]];                    \
      }                                                                                    \
      for (; j < e; j++) a0 += v[j] * x[idx[j]];                                           \
      y[r] = (a0 + a1) + (a2 + a3);                                                        \
    }                                                                                      \
  }                                                                                        \
}

/* Batched: xt is X^T ([in, B] row-major), y is [B, rows]. One AXPY of length B per
   nonzero into a per-row accumulator tile of 64, contiguous in xt so it vectorizes. */
#define SPMM(NAME, ITYPE)                                                                  \
void NAME(int64_t rows, int64_t chunk, int nthreads, const int64_t* rowptr,                \
          const ITYPE* idx, const float* v, const float* xt, float* y, int64_t B) {        \
  _Pragma("omp parallel for schedule(dynamic, 1) num_threads(nthreads)")                   \
  for (int64_t c0 = 0; c0 < rows; c0 += chunk) {                                           \
    float acc[64];                                                                         \
    int64_t c1 = c0 + chunk < rows ? c0 + chunk : rows;                                    \
    for (int64_t r = c0; r < c1; r++) {                                                    \
      for (int64_t b0 = 0; b0 < B; b0 += 64) {                                             \
        int64_t bw = B - b0 < 64 ? B - b0 : 64;                                            \
        memset(acc, 0, sizeof(acc));                                                       \
        for (int64_t j = rowptr[r]; j < rowptr[r + 1]; j++) {                              \
          const float w = v[j];                                                            \
          const float* restrict xr = xt + (int64_t)idx[j] * B + b0;                        \
          for (int64_t b = 0; b < bw; b++) acc[b] += w * xr[b];                            \
        }                                                                                  \
        for (int64_t b = 0; b < bw; b++) y[(b0 + b) * rows + r] = acc[b];                  \
      }                                                                                    \
    }                                                                                      \
  }                                                                                        \
}

SPMV(hfs_spmv_u16, uint16_t)
SPMV(hfs_spmv_i32, int32_t)
SPMM(hfs_spmm_u16, uint16_t)
SPMM(hfs_spmm_i32, int32_t)

int hfs_openmp(void) {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}
"""

_FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp", "-std=gnu11", "-shared", "-fPIC"],
    ["-O3", "-fopenmp", "-std=gnu11", "-shared", "-fPIC"],
    ["-O3", "-std=gnu11", "-shared", "-fPIC"],  # no OpenMP: single-threaded, still narrow indices
)

MIN_WORK_PER_THREAD = 32768  # multiply-adds; below this a parallel region costs more than it saves

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
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("model name", "flags")):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build(cc: str) -> str:
    import torch  # noqa: F401  (make sure torch's libgomp is loaded first, so the kernel binds to it)

    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    last = ""
    for flags in _FLAG_SETS:
        key = hashlib.sha256("|".join([SOURCE, " ".join(flags), version, _cpu_id()]).encode()).hexdigest()[
            :16
        ]
        out = os.path.join(cache_dir(), f"hfs_spmv_{key}.so")
        if os.path.isfile(out):
            return out
        os.makedirs(cache_dir(), exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
            src = os.path.join(tmp, "hfs_spmv.c")
            with open(src, "w") as f:
                f.write(SOURCE)
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
        from ..import_utils import c_compiler

        cc = c_compiler()
        try:
            if cc is None:
                raise RuntimeError("no C compiler found (set $CC) or HF_SPARSITY_NO_NATIVE is set")
            lib = ctypes.CDLL(_build(cc))
            vp, i64, ci = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
            for fn in (lib.hfs_spmv_u16, lib.hfs_spmv_i32):
                fn.argtypes, fn.restype = [i64, i64, ci, vp, vp, vp, vp, vp], None
            for fn in (lib.hfs_spmm_u16, lib.hfs_spmm_i32):
                fn.argtypes, fn.restype = [i64, i64, ci, vp, vp, vp, vp, vp, i64], None
            lib.hfs_openmp.restype = ci
            _lib = lib
        except Exception as e:  # any failure means: fall back to torch.sparse
            _error = str(e)
            logger.info("Native CSR kernel unavailable, using torch.sparse CSR instead: %s", e)
            _lib = None
        _tried = True
    return _lib


def error() -> str | None:
    """Why :func:`load` returned ``None`` (after it was called)."""
    return _error


class NativeCSR:
    """float32 CSR with 16-bit (or 32-bit) column indices and int64 row pointers, on CPU."""

    def __init__(self, rowptr: torch.Tensor, cols: torch.Tensor, values: torch.Tensor, shape):
        lib = load()
        if lib is None:
            raise RuntimeError(f"native kernel unavailable: {_error}")
        self.lib = lib
        self.rows, self.cols_n = int(shape[0]), int(shape[1])
        self.rowptr = rowptr.to(torch.int64).contiguous()
        if self.cols_n <= 65536:
            # Column indices < 65536 fit uint16; torch has no uint16 arithmetic, so store the bit pattern as int16.
            self.idx = cols.to(torch.int32).to(torch.int16).contiguous()
            self._spmv, self._spmm = lib.hfs_spmv_u16, lib.hfs_spmm_u16
        else:
            self.idx = cols.to(torch.int32).contiguous()
            self._spmv, self._spmm = lib.hfs_spmv_i32, lib.hfs_spmm_i32
        self.values = values.to(torch.float32).contiguous()
        self.nnz = int(self.values.numel())
        # ~16 chunks per thread: fine enough for dynamic balancing, coarse enough to stream rows
        self.chunk = max(8, -(-self.rows // (16 * max(1, torch.get_num_threads()))))

    @property
    def index_bytes(self) -> int:
        return self.idx.numel() * self.idx.element_size() + self.rowptr.numel() * 8

    def matmul(self, x2d: torch.Tensor, nthreads: int | None = None) -> torch.Tensor:
        """``x2d @ W^T`` for float32 ``x2d`` of shape ``[B, in]``; returns ``[B, out]`` float32."""
        x2d = x2d.to(torch.float32)
        batch = x2d.shape[0]
        if nthreads:
            nt = max(1, int(nthreads))
        else:  # small products run on one thread: waking the pool costs more than it saves
            nt = max(1, min(torch.get_num_threads(), (self.nnz * batch) // MIN_WORK_PER_THREAD))
        y = torch.empty(batch, self.rows, dtype=torch.float32)
        if batch == 0 or self.rows == 0:
            return y.zero_()
        if batch == 1:
            x = x2d.contiguous()
            self._spmv(
                self.rows, self.chunk, nt, self.rowptr.data_ptr(), self.idx.data_ptr(),
                self.values.data_ptr(), x.data_ptr(), y.data_ptr(),
            )  # fmt: skip
        else:
            xt = x2d.t().contiguous()
            self._spmm(
                self.rows, self.chunk, nt, self.rowptr.data_ptr(), self.idx.data_ptr(),
                self.values.data_ptr(), xt.data_ptr(), y.data_ptr(), batch,
            )  # fmt: skip
        return y
