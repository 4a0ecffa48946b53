"""int8 values and activations: per-row weight scales (:func:`quantize_rows`) and what the int8 products
see of their input (:func:`quantize_activations`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: ``(scales float32 [rows], codes int8 [rows, in])`` with ``w ~ scales[:, None] *
    codes``, ``scale = max|w_row| / 127`` (1 for an all-zero row), codes rounded to nearest."""
    wf = w.float()
    amax = wf.abs().amax(1) if wf.shape[1] else wf.new_zeros(wf.shape[0])
    scales = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    codes = torch.round(wf / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return scales.contiguous(), codes


ACT_GROUPS = 2
"""Activation scales per row when int8 values also quantize the activations: ``16 * ACT_GROUPS`` groups."""


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """What the products of ``values="int8"`` (with int8 activations, the default) see of their input ``x``
    ``[..., in]``: symmetric int8 codes ``round(x / s)`` (half to even), one scale ``s = max|x_group| / 127``
    per group of columns, dequantized back to float32 (``codes * s``). Column ``c`` is in group
    ``(c // 64 % ACT_GROUPS) * 16 + c % 64 // 4``: four adjacent columns every ``64 * ACT_GROUPS``, so a group
    is one lane of the native kernel's int32 accumulators (``csrc/packed_int8.c``) and its scale applies
    once per row. The native batch-1 kernel multiplies the codes themselves (int8 dot products); this is the
    same sum up to float32 rounding, for every other path (larger batches, the torch kernel, gradients)."""
    xf = x.float()
    n = xf.shape[-1]
    pad = (-n) % (64 * ACT_GROUPS)
    xb = F.pad(xf, (0, pad)).unflatten(-1, (-1, ACT_GROUPS, 16, 4))
    s = xb.abs().amax(dim=(-4, -1), keepdim=True) / 127
    codes = torch.where(s > 0, torch.round(xb / s), torch.zeros_like(xb)).clamp_(-127, 127)
    return (codes * s).flatten(-4)[..., :n]
