"""``masked_dense``: a dense matmul on ``W * mask``. Any device and dtype; the training default."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import BackendCapabilities, SparseBackend
from .registry import register_backend


@register_backend
class MaskedDenseBackend(SparseBackend):
    """Dense compute on the masked weight, read live on every call.

    Does every multiply-add a dense layer does (``macs`` counts the nonzero ones,
    ``macs_skipped`` the rest, for comparison); its value is exactness and autograd:
    the weight's gradient is masked by construction (``d(W*mask)/dW = mask``).
    """

    name = "masked_dense"
    aliases = ("dense", "masked")
    capabilities = BackendCapabilities(
        devices=("cpu", "cuda", "mps", "xpu"),
        dtypes=(torch.float32, torch.float64, torch.float16, torch.bfloat16),
        training=True,
        description="dense matmul on W*mask (training default; exact autograd)",
    )

    def _prepare(self) -> None:
        self._fmask = self.mask.to(self.weight.dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        self._count("forward", x.numel() // max(self.in_features, 1))
        return F.linear(x, self.weight * self._fmask, bias)

    __call__ = linear

    def _forward(self, x2d: torch.Tensor) -> torch.Tensor:
        return F.linear(x2d, self.weight.detach() * self._fmask)
