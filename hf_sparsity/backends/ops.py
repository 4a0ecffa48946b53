"""The native kernels as torch custom ops (``torch.ops.hf_sparsity.*``), for ``torch.compile``.

So that a compiled model traces through a sparse layer instead of breaking its graph at every
ctypes call. Eager code calls the kernels directly (a custom op's dispatch costs a few
microseconds per call, which adds up over ~200 layers per token); compiled code calls these.
They are defined with torch.library.Library (a schema, a CPU kernel, a fake kernel) rather than
torch.library.custom_op, whose Python autograd wrapper costs several microseconds more per call under
no_grad, paid at every sparse layer of every token. They have no autograd formula:
the inference backends call them only without gradients. Imported by ``hf_sparsity.backends``.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
from typing import Any

import torch

from . import _native

logger = logging.getLogger(__name__)

_LIB = torch.library.Library("hf_sparsity", "DEF")


def _define(schema: str, kernel, fake) -> None:
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    _LIB.impl(name, kernel, "CPU")
    torch.library.register_fake(f"hf_sparsity::{name}", lib=_LIB)(fake)


def packed_linear(
    x: torch.Tensor,
    values: torch.Tensor,
    meta: torch.Tensor | None,
    rowptr: torch.Tensor | None,
    bias: torch.Tensor | None,
    op: str,
    rows: int,
    nnz: int,
    nthreads: int,
) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for a bitmask / nm24 / dense-GEMV weight (``op``); any leading dims.
    ``nthreads`` 0: as many as keep :data:`MIN_WORK_PER_THREAD` multiply-adds each.

    Called once per sparse layer per token from compiled code, so it is kept lean (no re-checks:
    the backend validated its tensors at conversion): ~10 us per call against ~30 us through
    :func:`run_op`, which is 3.6 ms per token over SmolLM2-135M's 180 sparse layers."""
    in_f = x.shape[-1]
    if _native.decode_row(x, bias):  # decode: a prepared call (four ctypes arguments), as the eager fast path
        nt = _native.threads_for(nnz, nthreads or None)
        prep, addr = _native.prepared_call((  # ``prep`` stays referenced until the kernel call returns
            _native.OPS[op], rows, in_f, nt, None if rowptr is None else rowptr.data_ptr(),
            None if meta is None else meta.data_ptr(), values.data_ptr(), _native.vtype(values),
        ))  # fmt: skip
        y = torch.empty(*x.shape[:-1], rows, dtype=torch.float32)
        _native._lib.hfs_run_prepared(
            addr, x.data_ptr(), y.data_ptr(), None if bias is None else bias.data_ptr()
        )
        return y
    x2d = x.reshape(-1, in_f)
    if x2d.dtype != torch.float32 or not x2d.is_contiguous():
        x2d = x2d.float().contiguous()
    nt = _native.threads_for(nnz * x2d.shape[0], nthreads or None)
    y = _native.run_op(op, rows, in_f, x2d, values, meta, rowptr, bias, nt).view(*x.shape[:-1], rows)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def _packed_linear_fake(x, values, meta, rowptr, bias, op, rows, nnz, nthreads):
    return x.new_empty(*x.shape[:-1], rows)


def csr_linear(
    x: torch.Tensor,
    rowptr: torch.Tensor,
    idx: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor | None,
    rows: int,
    nthreads: int,
) -> torch.Tensor:
    """``x @ W^T (+ bias)`` with the native CSR kernel (16-bit indices when ``idx`` is int16);
    ``nthreads`` 0: as many as keep :data:`MIN_WORK_PER_THREAD` multiply-adds each."""
    lib = _native.load()
    in_f = x.shape[-1]
    if _native.decode_row(x, bias):  # decode: a prepared call, as in packed_linear
        nt = _native.threads_for(values.numel(), nthreads or None)
        kind = 16 + (0 if idx.dtype == torch.int16 else 1)
        key = (kind, rows, in_f, nt, rowptr.data_ptr(), idx.data_ptr(), values.data_ptr(), 0)
        prep, addr = _native.prepared_call(key)  # ``prep`` stays referenced until the kernel call returns
        y = torch.empty(*x.shape[:-1], rows, dtype=torch.float32)
        lib.hfs_run_prepared(addr, x.data_ptr(), y.data_ptr(), None if bias is None else bias.data_ptr())
        return y
    x2d = x.reshape(-1, in_f).float().contiguous()
    nt = _native.threads_for(values.numel() * x2d.shape[0], nthreads or None)
    y = _native.csr_matmul(rowptr, idx, values, rows, x2d, nt, bias)
    return y.view(*x.shape[:-1], rows).to(x.dtype)


def packed_unpack(
    values: torch.Tensor,
    meta: torch.Tensor,
    rowptr: torch.Tensor | None,
    op: str,
    rows: int,
    in_features: int,
    nthreads: int,
) -> torch.Tensor:
    """The dense float32 ``[rows, in]`` weight of a bitmask / 2:4 packed one (``op``: ``*_unpack``);
    ``nthreads`` 0: as many as keep :data:`MIN_WORK_PER_THREAD` elements each (times 4)."""
    nt = _native.threads_for(rows * in_features // 4, nthreads or None)
    return _native.run_op(op, rows, in_features, None, values, meta, rowptr, None, nt)


def csr_unpack(
    rowptr: torch.Tensor, idx: torch.Tensor, values: torch.Tensor, rows: int, cols: int
) -> torch.Tensor:
    """The dense float32 ``[rows, cols]`` weight of a native CSR one (see :func:`csr_unpack_into`)."""
    return _native.csr_unpack_into(torch.empty(rows, cols, dtype=torch.float32), rowptr, idx, values)


def _csr_unpack_fake(rowptr, idx, values, rows, cols):
    return values.new_empty(rows, cols, dtype=torch.float32)


def _packed_unpack_fake(values, meta, rowptr, op, rows, in_features, nthreads):
    return values.new_empty(rows, in_features, dtype=torch.float32)


def _csr_linear_fake(x, rowptr, idx, values, bias, rows, nthreads):
    return x.new_empty(*x.shape[:-1], rows)


_define(
    "packed_linear(Tensor x, Tensor values, Tensor? meta, Tensor? rowptr, Tensor? bias, str op, int rows, "
    "int nnz, int nthreads) -> Tensor",
    packed_linear,
    _packed_linear_fake,
)
_define(
    "csr_linear(Tensor x, Tensor rowptr, Tensor idx, Tensor values, Tensor? bias, int rows, int nthreads) "
    "-> Tensor",
    csr_linear,
    _csr_linear_fake,
)
_define(
    "packed_unpack(Tensor values, Tensor meta, Tensor? rowptr, str op, int rows, int in_features, "
    "int nthreads) -> Tensor",
    packed_unpack,
    _packed_unpack_fake,
)
_define(
    "csr_unpack(Tensor rowptr, Tensor idx, Tensor values, int rows, int cols) -> Tensor",
    csr_unpack,
    _csr_unpack_fake,
)


# ---------------------------------------------------------------------------- the C++ variants
# ``hf_sparsity_cpp::packed_linear`` / ``csr_linear``: the same schemas and kernels with a C++ body
# (``csrc/hfs_ops.cpp``), so a compiled graph calls them through the dispatcher without Python: one
# 64x64 layer, 5.0 us per call from Python against 12.9 us for the Python-implemented op. Built on
# request (``build_cpp_ops``, called by ``compiled_generate_kwargs``) with torch.utils.cpp_extension
# (needs ninja and a C++ compiler; ~10 s once, then cached next to the C kernels); without them the
# Python ops above serve. ``HF_SPARSITY_NO_CPP_OPS=1`` skips the build.
CPP_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "hfs_ops.cpp")
_cpp_state: dict[str, Any] = {"ready": False, "error": None, "tried": False}


def build_cpp_ops() -> bool:
    """Build and load the C++ custom ops once per process; ``True`` if they serve from now on.
    Why they could not be built: :func:`cpp_ops_error`."""
    if _cpp_state["tried"]:
        return _cpp_state["ready"]
    _cpp_state["tried"] = True
    try:
        if os.environ.get("HF_SPARSITY_NO_CPP_OPS") == "1":
            raise RuntimeError("HF_SPARSITY_NO_CPP_OPS=1")
        lib = _native.load()
        if lib is None:
            raise RuntimeError(f"the native kernel is unavailable: {_native.error()}")
        # Lazy: cpp_extension imports setuptools; needed only when the C++ ops are built.
        from torch.utils import cpp_extension

        if not cpp_extension.is_ninja_available():
            raise RuntimeError("ninja is not installed (pip install ninja)")
        with open(CPP_SOURCE, "rb") as f:
            key = hashlib.sha256(f.read() + torch.__version__.encode()).hexdigest()[:12]
        build_dir = os.path.join(_native.cache_dir(), f"torch_ops_{key}")
        os.makedirs(build_dir, exist_ok=True)
        cpp_extension.load(
            name=f"hfs_ops_{key}", sources=[CPP_SOURCE], extra_cflags=["-O2"], is_python_module=False,
            build_directory=build_dir, verbose=False,
        )  # fmt: skip
        run = ctypes.cast(lib.hfs_run, ctypes.c_void_p).value
        matmul = ctypes.cast(lib.hfs_matmul, ctypes.c_void_p).value
        torch.ops.hf_sparsity_cpp.set_kernels(run, matmul)
        torch.library.register_fake("hf_sparsity_cpp::packed_linear")(_packed_linear_fake)
        torch.library.register_fake("hf_sparsity_cpp::csr_linear")(_csr_linear_fake)
        _cpp_state["ready"] = True
    except Exception as e:  # noqa: BLE001 - any failure: the Python ops serve
        _cpp_state["error"] = f"{type(e).__name__}: {e}"
        logger.info("hf_sparsity: C++ custom ops unavailable, the Python ones serve: %s", _cpp_state["error"])
    return _cpp_state["ready"]


def cpp_ops_error() -> str | None:
    """Why :func:`build_cpp_ops` could not build the C++ ops (``None``: built, or not tried)."""
    return _cpp_state["error"]


def linear_op(name: str):
    """``torch.ops.hf_sparsity_cpp.<name>`` once :func:`build_cpp_ops` succeeded, else the Python op
    ``torch.ops.hf_sparsity.<name>`` (``packed_linear`` or ``csr_linear``). Never builds anything."""
    ns = torch.ops.hf_sparsity_cpp if _cpp_state["ready"] else torch.ops.hf_sparsity
    return getattr(ns, name)
