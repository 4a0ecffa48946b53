"""Compact CPU formats for moderate sparsity: ``bitmask`` and ``nm24`` (2:4), plus ``native_dense``.

At 50-75% sparsity CSR does not pay: fp32 values with 16-bit column indices read 3 bytes
per weight at 50% against dense's 4, and decoding is memory-bound. These formats read
close to the bound:

* ``bitmask``: one bit per weight (kept or not) plus the kept values packed in row order.
  fp32 values: ``4 * density + 0.125`` bytes per weight (2.125 at 50%, 1.8x fewer than
  dense); bf16 values: ``2 * density + 0.125``. Any unstructured mask.
* ``nm24``: 2:4 along the input dimension: two values per four weights and their two
  2-bit positions, one byte per eight weights (fp32: 2.125 bytes per weight; bf16: 1.125).
  Refuses a mask that is not 2:4.
* ``native_dense``: the masked weight stored dense, multiplied by the native multi-threaded
  GEMV for small batches (torch's fp32 GEMV may use one core). Used by ``auto`` for layers
  where dense wins and for the LM head; it is "dense with the same improvements".

Values are fp32 or bf16 (the weight's dtype), or, for ``bitmask`` and ``nm24`` with
``values="int8"``, int8 with one symmetric float32 scale per output row (round to nearest, computed at
conversion: ``scale = max|w_row| / 127``): 0.625 bytes per weight at 50% with a bitmask. Their products
quantize the activations too (``activations="int8"``, the default; see :func:`quantize_activations`): a
batch-1 product multiplies int8 by int8 (AVX-512 VNNI, AVX-VNNI or AVX2; ``_native.int8_dot()``), larger
batches and the scalar build put the dequantized activations through the float kernels.
``activations="float32"`` keeps float32 activations (``sum(q * x) * scale`` in fp32).
``to_dense()`` returns the dequantized weight. The native
AVX2/FMA kernels (:mod:`hf_sparsity.backends._native`, ``csrc/``) run batch 1
and small batches; larger batches (prefill) go through a dense GEMM on the weight rebuilt
on the fly (``prefill="unpack"``, default: no dense copy kept) or, from 17 rows, the native
blocked sparse kernel (``prefill="native"``; ``hfs_spmm`` in the C source: as fast as dense at
50% and faster above; ``auto`` measures both). Without a C compiler a pure-torch path computes the same thing,
slowly (it rebuilds the dense weight per call).

These backends keep **no dense copy**: after ``from_dense`` the weight and mask tensors are
dropped; ``weight`` / ``mask`` / ``to_dense()`` rebuild them from the packed form.
Inference only (``capabilities.training`` is False); gradients of ``x`` still flow.

One format per module over a shared base, as compressed-tensors lays out its formats:
:mod:`.base` (:class:`_PackedBackend`, bit packing, the prefill scratch buffer), :mod:`.quant` (int8
values and activations), :mod:`.bitmask`, :mod:`.nm24`, :mod:`.native_dense`.
"""

from .base import SMALL_BATCH, _pack_bits, _PackedBackend, _unpack_bits, scratch_buffer  # noqa: F401
from .bitmask import BitmaskBackend
from .native_dense import NativeDenseBackend
from .nm24 import NM24Backend
from .quant import ACT_GROUPS, quantize_activations, quantize_rows

__all__ = [
    "ACT_GROUPS",
    "SMALL_BATCH",
    "BitmaskBackend",
    "NM24Backend",
    "NativeDenseBackend",
    "quantize_activations",
    "quantize_rows",
    "scratch_buffer",
]
