"""``native_dense``: the masked weight stored dense, multiplied by the native multi-threaded GEMV."""

from __future__ import annotations

import torch

from ...utils import SparsityError
from .. import _native
from ..registry import register_backend
from .base import _PackedBackend, packed_capabilities


@register_backend
class NativeDenseBackend(_PackedBackend):
    """The masked weight kept dense; a multi-threaded native GEMV for small batches, ``F.linear`` above."""

    name = "native_dense"
    op = "gemv"
    aliases = ("gemv",)
    capabilities = packed_capabilities(
        "dense weight, native multi-threaded GEMV for batch <= 16 (LM head, dense layers)"
    )

    def _pack(self, w: torch.Tensor, m: torch.Tensor) -> None:
        if self.int8:  # ``w``: the int8 codes of the masked weight, row-major after the row scales
            self.values = self._store(w, 64)
            return
        self.values = (
            (w * m).to(self.dtype).contiguous() if not bool(m.all()) else w.to(self.dtype).contiguous()
        )

    _TENSORS = ("values",)

    def _native_mm(self, x2d, bias):
        return _native.run_op(
            "gemv", self.out_features, self.in_features, x2d, self.values, None, None, bias,
            self._threads(x2d.shape[0]), int8_activations=self.int8_activations,
        )  # fmt: skip

    def to_dense(self) -> torch.Tensor:
        return self._unpack().to(self.dtype) if self.int8 else self.values

    def _unpack(self) -> torch.Tensor:
        if not self.int8:
            return self.values
        n = self.out_features * self.in_features
        return self._scaled(self._codes()[:n].view(self.out_features, self.in_features).clone())

    def int8_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(codes int8 [out, in], scales float32 [out])``: views of the int8 values' buffer (no copy), row
        ``r`` standing for ``codes[r] * scales[r]``. What a tied input embedding reads (the rows of an int8
        LM head: :class:`hf_sparsity.inference.conversion.Int8Embedding`)."""
        if not self.int8:
            raise SparsityError(f"{self.name}: int8_rows needs int8 values (values='int8').")
        n = self.out_features * self.in_features
        sb = _native.scale_bytes(self.out_features)
        return self.values[sb : sb + n].view(self.out_features, self.in_features), self.scales

    def _dense_mask(self) -> torch.Tensor:
        return (self._unpack() != 0).to(torch.uint8)
