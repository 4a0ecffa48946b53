"""``auto``'s cost model and candidates: the formats it measures, the bytes each reads per decoding
call (:func:`decode_bytes`), building a candidate for a layer, the versions a cached plan depends on."""

from __future__ import annotations

import logging

import torch

from ...utils import SparsityError
from ..base import SparseBackend, check_nm
from ..registry import get_backend

logger = logging.getLogger("hf_sparsity.backends.auto")

DTYPES = (torch.float32, torch.bfloat16)  # what auto runs on (CPU)
CANDIDATES = ("dense", "native_dense", "bitmask", "nm24", "csr")


DENSE = ("dense", "native_dense")


PLAN_KEYS = (
    "decode", "decode_vs_dense", "prefill", "prefill_vs_dense", "prefill_large", "prefill_large_vs_dense",
)  # fmt: skip
"""What ``auto`` decided for a layer, in each choice dict: decode format, prefill mode up to twice
``prefill_batch`` rows and above, each with its speed against dense."""


CALL_MS = 0.004
"""The cost model's fixed time per product call (Python and kernel launch), in milliseconds: small layers
cost their calls more than their bytes."""


PLAN_VERSION = 5
"""Bumped when a cached plan would no longer mean the same (kernels, cost model, decision rules)."""


def _is_24(mask: torch.Tensor) -> bool:
    try:
        check_nm(mask, 2, 4)
        return True
    except SparsityError:
        return False


def _build(
    fmt: str, w: torch.Tensor, m: torch.Tensor, threads: int | None, values: str | None = None
) -> SparseBackend:
    if fmt == "dense":
        return get_backend("native_dense").from_dense(w, m, kernel="torch")
    if fmt == "native_dense":  # int8 values: the dense int8 GEMV (int8 activations), the dense int8 model's
        return get_backend(fmt).from_dense(w, m, threads=threads, values=values)
    if fmt == "csr":
        b = get_backend("csr").from_dense(w, m, kernel="native", threads=threads)
        b.release_dense()  # auto never trains or refreshes a layer
        return b
    return get_backend(fmt).from_dense(w, m, prefill="native", threads=threads, values=values)


def decode_bytes(fmt: str, out_f: int, in_f: int, nnz: int, dtype: torch.dtype, values: str | None) -> int:
    """Bytes one batch-1 product reads from the weight in format ``fmt`` (the cost model): values,
    positions / indices, row offsets and, for int8 values, the row scales."""
    esize = torch.empty((), dtype=dtype).element_size()
    vsize = 1 if values == "int8" else esize
    scales = 4 * out_f if values == "int8" else 0
    if fmt == "dense":  # torch's float GEMV: the weight as it is
        return out_f * in_f * esize
    if fmt == "native_dense":
        return out_f * in_f * vsize + scales
    bits = out_f * ((in_f + 7) // 8)
    if fmt == "bitmask":
        return nnz * vsize + bits + 8 * (out_f + 1) + scales
    if fmt == "nm24":
        return out_f * (in_f // 2) * vsize + bits + scales
    if fmt == "csr":
        return nnz * (4 + (2 if in_f <= 65536 else 4)) + 8 * (out_f + 1)
    raise SparsityError(f"auto: no cost model for format {fmt!r}.")


def _product_input(b, x: torch.Tensor) -> torch.Tensor:
    return b.product_input(x) if hasattr(b, "product_input") else x
