"""``nm24``: 2:4 along the input dimension, two values and their 2-bit positions per four weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _native
from ..registry import register_backend
from .base import _PackedBackend, packed_capabilities


@register_backend
class NM24Backend(_PackedBackend):
    """2:4 along the input dimension on CPU: two values and two 2-bit positions per four weights."""

    name = "nm24"
    op = "nm24"
    aliases = ("cpu_2_4", "nm_2_4")
    capabilities = packed_capabilities(
        "CPU 2:4: packed values + 2-bit positions (fp32 / bf16, or int8 with row scales)", structure="2:4"
    )

    def _pack(self, w: torch.Tensor, m: torch.Tensor) -> None:
        out_f, in_f = w.shape
        g = m.view(out_f, in_f // 4, 4)
        # the two kept positions of each group (a group keeping fewer is padded with unused positions)
        key = (~g).to(torch.int8) * 4 + torch.arange(4, dtype=torch.int8)
        pos = key.argsort(dim=-1, stable=True)[..., :2].sort(-1).values  # [out, groups, 2], ascending
        vals = torch.gather((w * m).view(out_f, in_f // 4, 4), 2, pos)
        self.values = self._store(vals, 8)
        nib = (pos[..., 0] | (pos[..., 1] << 2)).to(torch.uint8)  # [out, groups]
        if nib.shape[1] % 2:
            nib = F.pad(nib, (0, 1))
        nib = nib.view(out_f, -1, 2)
        self.meta = (nib[..., 0] | (nib[..., 1] << 4)).contiguous()  # [out, ceil(in/8)]

    _TENSORS = ("meta", "values")

    def _positions(self) -> torch.Tensor:
        out_f, groups = self.out_features, self.in_features // 4
        nib = torch.stack([self.meta & 15, self.meta >> 4], -1).view(out_f, -1)[:, :groups].long()
        return torch.stack([nib & 3, nib >> 2], -1)  # [out, groups, 2]

    def _native_mm(self, x2d, bias):
        return _native.run_op(
            "nm24", self.out_features, self.in_features, x2d, self.values, self.meta, None, bias,
            self._threads(x2d.shape[0]), int8_activations=self.int8_activations,
        )  # fmt: skip

    def _unpack(self) -> torch.Tensor:
        out_f, in_f = self.out_features, self.in_features
        if self.kernel == "native" and out_f * in_f:
            threads = _native.threads_for(out_f * in_f // 4, self.threads)
            return _native.run_op(
                "nm24_unpack", out_f, in_f, None, self.values, self.meta, None, None, threads
            )
        out = torch.zeros(out_f, in_f // 4, 4, dtype=torch.float32)
        vals = self._codes()[: out_f * in_f // 2].view(out_f, in_f // 4, 2)
        out.scatter_(2, self._positions(), vals)
        return self._scaled(out.view(out_f, in_f))

    def _dense_mask(self) -> torch.Tensor:
        # the kept positions with a stored value; a padded slot (group keeping fewer than 2) holds 0
        return (self._unpack() != 0).to(torch.uint8) if self.nnz < self.mask_slots else self._slot_mask()

    @property
    def mask_slots(self) -> int:
        return self.out_features * self.in_features // 2

    def _slot_mask(self) -> torch.Tensor:
        out_f, in_f = self.out_features, self.in_features
        out = torch.zeros(out_f, in_f // 4, 4, dtype=torch.uint8)
        out.scatter_(2, self._positions(), 1)
        return out.view(out_f, in_f)
