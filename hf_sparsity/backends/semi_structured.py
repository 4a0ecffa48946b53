"""``semi_structured``: 2:4 sparsity through torch's semi-structured tensors (CUDA, compute capability >=
8.0).

Needs 2:4 masks along the input dimension (keep at most 2 of every 4 consecutive
weights of a row of the ``[out, in]`` weight): build them with
``SparsityConfig(structure="2:4")`` or :func:`hf_sparsity.masks.nm_mask`. The sparse
tensor is a snapshot (``capabilities.training`` is False); the backward pass uses the
masked dense weight for ``grad x`` and masks ``grad W``.

torch's kernels (CUTLASS, or cuSPARSELt when present) need float16 / bfloat16 (and
float32 on some builds), and shapes that are multiples of the kernel's tile; the
forward pads the batch to a multiple of the minimum row count and falls back to
the dense masked weight (with a one-time warning) when torch refuses the shape.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.nn.functional as F

from ..import_utils import semi_structured_unavailable_reason
from .base import BackendCapabilities, SparseBackend
from .registry import register_backend

logger = logging.getLogger(__name__)

_PAD_ROWS = 64  # conservative multiple for the dense operand's row count (CUTLASS needs 8/16/32/64 by dtype)


@register_backend
class SemiStructuredBackend(SparseBackend):
    """2:4 semi-structured sparse weight on a CUDA GPU (``torch.sparse.to_sparse_semi_structured``)."""

    name = "semi_structured"
    aliases = ("2:4", "nm", "semi")
    capabilities = BackendCapabilities(
        devices=("cuda",),
        dtypes=(torch.float16, torch.bfloat16, torch.float32),
        training=False,
        structure="2:4",
        description="2:4 semi-structured sparsity via torch (CUDA, Ampere+)",
    )

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return semi_structured_unavailable_reason()

    def _prepare(self) -> None:
        # Lazy: only a CUDA device runs this backend.
        from torch.sparse import to_sparse_semi_structured

        dense = (self.weight.detach() * self.mask.to(self.weight.dtype)).contiguous()
        self._dense = dense
        self._fallback = False
        try:
            self._sparse = to_sparse_semi_structured(dense)
        except Exception as e:  # shape or dtype the kernels do not support
            logger.warning("semi_structured: torch refused %s %s (%s); using the dense masked weight.",
                           tuple(dense.shape), dense.dtype, e)  # fmt: skip
            self._sparse, self._fallback = None, True

    def _forward(self, x2d: torch.Tensor) -> torch.Tensor:
        self._count("forward", x2d.shape[0])
        x = x2d.to(self._dense.dtype)
        if self._fallback:
            return F.linear(x, self._dense)
        batch = x.shape[0]
        pad = (-batch) % _PAD_ROWS
        if pad:
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                y = F.linear(x, self._sparse)
        except Exception as e:
            logger.warning("semi_structured: sparse matmul failed (%s); using the dense masked weight.", e)
            self._fallback = True
            return F.linear(x2d.to(self._dense.dtype), self._dense)
        return y[:batch]

    def to_dense(self) -> torch.Tensor:
        return self._dense
