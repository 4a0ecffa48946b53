"""``csr``: compressed sparse rows, for inference on CPU and GPU.

Two kernels behind one format:

* ``native`` (CPU, float32 compute): the row-parallel kernel of
  :mod:`hf_sparsity.backends._native`, 16-bit column indices, made for batch-1
  decoding; batched inputs run one AXPY of the batch per nonzero.
* ``torch`` (any device and dtype torch.sparse supports): ``torch.sparse_csr_tensor``
  with int32 indices and ``torch.sparse.mm``.

``kernel="auto"`` (default) picks ``native`` for CPU weights when it builds and
``torch`` otherwise. The values are a snapshot taken by ``from_dense``
(``capabilities.training`` is False); gradients still flow (``grad x`` through the
masked dense weight, ``grad W`` at kept positions only).
"""

from __future__ import annotations

import warnings

import torch

from ..utils import SparsityError
from . import _native, ops
from .base import BackendCapabilities, SparseBackend
from .formats import scratch_buffer
from .registry import register_backend

KERNELS = ("auto", "native", "torch")
NATIVE_MAX_BATCH = 16
"""Above this many rows of ``x`` (prefill, batched scoring), where the native kernel was built without SIMD,
``kernel="auto"`` hands the product to torch.sparse CSR (built lazily, int32 indices). With AVX2 / AVX-512
the native blocked kernel takes every batch (it is faster than torch.sparse's MKL path)."""


def _csr_parts(weight: torch.Tensor, mask: torch.Tensor):
    """(rowptr int64, cols int64, values) of ``weight`` at the mask's kept positions, row-major order."""
    m = mask.bool()
    rows, cols = m.nonzero(as_tuple=True)
    counts = torch.bincount(rows, minlength=weight.shape[0])
    rowptr = torch.zeros(weight.shape[0] + 1, dtype=torch.int64, device=weight.device)
    torch.cumsum(counts, 0, out=rowptr[1:])
    return rowptr, cols, weight.detach()[rows, cols]


@register_backend
class CSRBackend(SparseBackend):
    """CSR storage; native batch-1 kernel on CPU, torch.sparse CSR elsewhere.

    Options: ``kernel`` (``auto`` | ``native`` | ``torch``), ``threads`` (native
    kernel threads, default ``torch.get_num_threads()``).
    """

    name = "csr"
    aliases = ("sparse_csr",)
    capabilities = BackendCapabilities(
        devices=("cpu", "cuda"),
        dtypes=(torch.float32, torch.float64, torch.float16, torch.bfloat16),
        training=False,
        description="CSR for inference: native 16-bit-index row-parallel kernel on CPU, torch.sparse "
        "elsewhere",
    )

    def _prepare(self) -> None:
        kernel = self.options.get("kernel", "auto")
        if kernel not in KERNELS:
            raise SparsityError(f"csr: unknown kernel {kernel!r}; use one of {', '.join(KERNELS)}.")
        self.threads = self.options.get("threads")
        w = self.weight
        rowptr, cols, values = _csr_parts(w, self.mask)
        native_ok = w.device.type == "cpu" and w.dtype in (torch.float32, torch.float16, torch.bfloat16)
        if kernel == "native" and not native_ok:
            raise SparsityError(
                f"csr: the native kernel runs on CPU for float32/float16/bfloat16 weights, not {w.dtype} on "
                f"{w.device}. Use kernel='torch'."
            )
        if kernel == "native" and _native.load() is None:
            raise SparsityError(f"csr: the native kernel is unavailable here: {_native.error()}")
        self._native = None
        self._torch = None
        self._native_batched = kernel == "native" or _native.simd()  # see NATIVE_MAX_BATCH
        if kernel in ("auto", "native") and native_ok and _native.load() is not None:
            self.kernel = "native"
            self._native = _native.NativeCSR(rowptr, cols, values, w.shape)
        else:
            self.kernel = "torch"
            if w.device.type == "cpu" and w.dtype in (torch.float16, torch.bfloat16):
                values = values.float()  # torch's CPU CSR matmul (MKL) has no half-precision kernels
            with warnings.catch_warnings():  # "Sparse CSR tensor support is in beta state"
                warnings.simplefilter("ignore", UserWarning)
                self._torch = torch.sparse_csr_tensor(
                    rowptr.to(torch.int32), cols.to(torch.int32), values, size=tuple(w.shape)
                )
        self._dense_cache = None

    def release_dense(self) -> None:
        """Drop the dense weight and mask this backend keeps (for ``refresh`` and training) once it is
        known to serve inference only; the native CSR arrays stay. Only with the native kernel."""
        if self._native is None:
            raise SparsityError("csr: release_dense needs the native kernel (torch.sparse reads the weight).")
        self.weight = torch.empty(0, dtype=self.weight.dtype)
        self.mask = torch.ones((), dtype=torch.uint8).expand(self.out_features, self.in_features)

    @property
    def index_bytes(self) -> int:
        """Bytes of column indices plus row pointers."""
        if self._native is not None:
            return self._native.index_bytes
        t = self._torch
        return t.col_indices().numel() * 4 + t.crow_indices().numel() * 4

    def storage_tensors(self) -> list[torch.Tensor]:
        if self._native is not None:
            return [self._native.rowptr, self._native.idx, self._native.values]
        return [self.weight, self.mask]

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W^T (+ bias)``; inference calls on the native kernel add the bias inside it."""
        nat = self._native
        if (
            nat is None
            or x.dtype not in (torch.float32, torch.float16, torch.bfloat16)  # computed in float32
            or x.shape[-1] != self.in_features
            or (
                torch.is_grad_enabled()
                and (
                    x.requires_grad or self.weight.requires_grad or (bias is not None and bias.requires_grad)
                )
            )
        ):
            return super().linear(x, bias)
        x2d = x.reshape(-1, self.in_features)
        big = x2d.shape[0] > NATIVE_MAX_BATCH and not self._native_batched
        if torch.compiler.is_compiling():  # custom ops: no graph break at this layer
            if big:  # torch.sparse does not compile: one dense GEMM on the unpacked weight
                return torch.nn.functional.linear(x, self.dense_for_matmul().to(x.dtype), bias)
            return ops.linear_op("csr_linear")(
                x, nat.rowptr, nat.idx, nat.values, bias, nat.rows, self.threads or 0
            )
        if big:
            return super().linear(x, bias)
        self._count("forward", x2d.shape[0])
        return nat.matmul(x2d, self.threads, bias).view(*x.shape[:-1], self.out_features).to(x.dtype)

    __call__ = linear

    def decode_call(self):
        nat = self._native
        if nat is None or nat.values.dtype != torch.float32:
            return None
        nt = _native.threads_for(nat.values.numel(), self.threads)
        kind = 16 + (0 if nat.idx.dtype == torch.int16 else 1)
        return _native.prepared_call(
            (kind, nat.rows, self.in_features, nt, nat.rowptr.data_ptr(), nat.idx.data_ptr(),
             nat.values.data_ptr(), 0)
        )  # fmt: skip

    def _forward(self, x2d: torch.Tensor) -> torch.Tensor:
        self._count("forward", x2d.shape[0])
        nat = self._native
        if nat is not None and (x2d.shape[0] <= NATIVE_MAX_BATCH or self._native_batched):
            y = nat.matmul(x2d, self.threads)
            return y if x2d.dtype == torch.float32 else y.to(x2d.dtype)
        if self._torch is None:  # batched input on a native-prepared weight: build the torch CSR once
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                self._torch = torch.sparse_csr_tensor(
                    nat.rowptr.to(torch.int32),
                    nat.idx.to(torch.int32) & 0xFFFF if nat.idx.dtype == torch.int16 else nat.idx,
                    nat.values,
                    size=(nat.rows, nat.cols_n),
                )
        x = x2d.to(self._torch.dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.sparse.mm(self._torch, x.t()).t().to(x2d.dtype)

    def dense_for_matmul(self) -> torch.Tensor:
        """The dense float32 weight for one GEMM (prefill), without autograd: written into a per-thread
        buffer reused across calls (see ``formats.scratch_buffer``; valid until the next call for this
        shape on this thread), or under ``torch.compile`` a fresh tensor from a custom op."""
        n = self._native
        if n is None:
            return self.to_dense()
        if torch.compiler.is_compiling():
            return torch.ops.hf_sparsity.csr_unpack(n.rowptr, n.idx, n.values, n.rows, n.cols_n)
        return _native.csr_unpack_into(scratch_buffer(n.rows, n.cols_n), n.rowptr, n.idx, n.values)

    def to_dense(self) -> torch.Tensor:
        if self._native is not None:
            n = self._native
            rows = torch.repeat_interleave(torch.arange(n.rows), n.rowptr.diff())
            cols = n.idx.to(torch.int64) & 0xFFFF if n.idx.dtype == torch.int16 else n.idx.to(torch.int64)
            out = torch.zeros(n.rows, n.cols_n, dtype=self.weight.dtype)
            out[rows, cols] = n.values.to(self.weight.dtype)
            return out
        return self._torch.to_dense().to(self.weight.dtype)
