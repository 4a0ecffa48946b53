"""``bitmask``: one bit per weight plus the kept values packed in row order (any unstructured mask)."""

from __future__ import annotations

import torch

from .. import _native
from ..registry import register_backend
from .base import _pack_bits, _PackedBackend, _unpack_bits, packed_capabilities


@register_backend
class BitmaskBackend(_PackedBackend):
    """1 bit per weight + packed kept values (fp32 or bf16). Any unstructured mask, CPU."""

    name = "bitmask"
    op = "bitmask"
    capabilities = packed_capabilities(
        "1-bit mask + packed values (fp32 / bf16, or int8 with row scales); native kernels"
    )

    def _pack(self, w: torch.Tensor, m: torch.Tensor) -> None:
        self.bits = _pack_bits(m).contiguous()
        counts = m.sum(1, dtype=torch.int64)
        self.rowptr = torch.zeros(self.out_features + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=self.rowptr[1:])
        # the kernels read 16 values, or 64 int8 codes, at a time
        self.values = self._store(w[m], 64 if self.int8 else 16)

    _TENSORS = ("bits", "rowptr", "values")

    def _native_mm(self, x2d, bias):
        return _native.run_op(
            "bitmask", self.out_features, self.in_features, x2d, self.values, self.bits, self.rowptr,
            bias, self._threads(x2d.shape[0]), int8_activations=self.int8_activations,
        )  # fmt: skip

    def _dense_mask(self) -> torch.Tensor:
        return _unpack_bits(self.bits, self.in_features).to(torch.uint8)

    def _unpack(self) -> torch.Tensor:
        if self.kernel == "native" and self.out_features * self.in_features:
            threads = _native.threads_for(self.out_features * self.in_features // 4, self.threads)
            return _native.run_op(
                "bitmask_unpack", self.out_features, self.in_features, None, self.values, self.bits,
                self.rowptr, None, threads,
            )  # fmt: skip
        out = torch.zeros(self.out_features, self.in_features, dtype=torch.float32)
        out[_unpack_bits(self.bits, self.in_features)] = self._codes()[: self.nnz]
        return self._scaled(out)
