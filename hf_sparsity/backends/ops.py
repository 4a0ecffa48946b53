"""The native kernels as torch custom ops (``torch.ops.hf_sparsity.*``), for ``torch.compile``.

So that a compiled model traces through a sparse layer instead of breaking its graph at every
ctypes call. Eager code calls the kernels directly (a custom op's dispatch costs a few
microseconds per call, which adds up over ~200 layers per token); compiled code calls these.
They are defined with torch.library.Library (a schema, a CPU kernel, a fake kernel) rather than
torch.library.custom_op, whose Python autograd wrapper costs ~9 us more per call under no_grad
(12.6 against 3.9 us measured; ~1.6 ms per token over 180 layers). They have no autograd formula:
the inference backends call them only without gradients. Imported by ``hf_sparsity.backends``.
"""

from __future__ import annotations

import ctypes

import torch

from . import _native

_PREPARED: dict[tuple, tuple] = {}
"""Prepared batch-1 calls of the custom ops, keyed by every argument they hold (so a hit is exactly the
call the general path would make, whatever tensor object is passed)."""


def prepared_call(key: tuple) -> int:
    """The address of a :class:`Prepared` for ``key`` = ``(op, rows, in_features, nthreads, rowptr,
    meta, values, vbf16)`` (pointers as ints), built on first use; the cache is cleared past 4096."""
    hit = _PREPARED.get(key)
    if hit is None:
        if len(_PREPARED) > 4096:
            _PREPARED.clear()
        op, rows, in_f, nt, rowptr, meta, values, bf16 = key
        prep = _native.Prepared(op, rows, in_f, _native.chunk_rows(rows, nt), nt, rowptr, meta, values, bf16)
        hit = _PREPARED[key] = (prep, ctypes.addressof(prep))
    return hit[1]


def _decode_row(x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """One contiguous float32 row (and a float32 contiguous bias or none): the prepared-call path."""
    return (
        x.numel() == x.shape[-1]
        and x.dtype == torch.float32
        and x.is_contiguous()
        and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
    )


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
    if _decode_row(x, bias):  # decode: a prepared call (four ctypes arguments), as the eager fast path
        nt = nthreads or max(1, min(torch.get_num_threads(), nnz // _native.MIN_WORK_PER_THREAD))
        addr = prepared_call((
            _native.OPS[op], rows, in_f, nt, None if rowptr is None else rowptr.data_ptr(),
            None if meta is None else meta.data_ptr(), values.data_ptr(), int(values.dtype == torch.bfloat16),
        ))  # fmt: skip
        y = torch.empty(*x.shape[:-1], rows, dtype=torch.float32)
        _native._lib.hfs_run_prepared(
            addr, x.data_ptr(), y.data_ptr(), None if bias is None else bias.data_ptr()
        )
        return y
    x2d = x.reshape(-1, in_f)
    if x2d.dtype != torch.float32 or not x2d.is_contiguous():
        x2d = x2d.float().contiguous()
    batch = x2d.shape[0]
    nt = nthreads or max(1, min(torch.get_num_threads(), nnz * batch // _native.MIN_WORK_PER_THREAD))
    y = torch.empty(*x.shape[:-1], rows, dtype=torch.float32)
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    if batch and rows:
        _native._lib.hfs_run(
            _native.OPS[op], rows, in_f, _native.chunk_rows(rows, nt), nt,
            None if rowptr is None else rowptr.data_ptr(), None if meta is None else meta.data_ptr(),
            values.data_ptr(), int(values.dtype == torch.bfloat16), x2d.data_ptr(), y.data_ptr(), batch,
            None if bias is None else bias.data_ptr(),
        )  # fmt: skip
    elif bias is not None:
        y.copy_(bias.expand_as(y))
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
    if _decode_row(x, bias):  # decode: a prepared call, as in packed_linear
        nt = _native.threads_for(values.numel(), nthreads or None)
        kind = 16 + (0 if idx.dtype == torch.int16 else 1)
        addr = prepared_call((kind, rows, in_f, nt, rowptr.data_ptr(), idx.data_ptr(), values.data_ptr(), 0))
        y = torch.empty(*x.shape[:-1], rows, dtype=torch.float32)
        lib.hfs_run_prepared(addr, x.data_ptr(), y.data_ptr(), None if bias is None else bias.data_ptr())
        return y
    x2d = x.reshape(-1, in_f).float().contiguous()
    batch = x2d.shape[0]
    nthreads = _native.threads_for(values.numel() * batch, nthreads or None)
    y = torch.empty(batch, rows, dtype=torch.float32)
    if batch and rows:
        kind = (0 if idx.dtype == torch.int16 else 1) + (0 if batch == 1 else 2)
        xx = x2d if batch == 1 else x2d.t().contiguous()
        if bias is not None:
            bias = bias.float().contiguous()
        chunk = _native.chunk_rows(rows, nthreads)
        lib.hfs_matmul(
            kind, rows, chunk, nthreads, rowptr.data_ptr(), idx.data_ptr(), values.data_ptr(),
            xx.data_ptr(), y.data_ptr(), batch, None if bias is None else bias.data_ptr(),
        )  # fmt: skip
    elif bias is not None:
        y.copy_(bias.float().expand_as(y))
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
