"""``bitmask``: one bit per weight plus the kept values packed in row order (any unstructured mask)."""

from __future__ import annotations

import torch

from ...utils import SparsityError
from .. import _native
from ..registry import register_backend
from .base import _pack_bits, _PackedBackend, _unpack_bits, packed_capabilities

LAYOUTS = ("auto", "mask", "gather")
GATHER_ISAS = ("avx2", "avx2-vnni")
"""The kernel builds whose batch-1 product ``layout="auto"`` runs on the gathered layout where it pays (AVX2:
a mask byte costs the same at any density; the AVX-512 kernels expand sixteen columns per instruction)."""


GATHER_CHUNK_GROUPS = 2.0
"""What one chunk of the gathered bitmask layout (:func:`bitmask_gather`) costs, in mask bytes (groups of
eight columns) of the bitmask kernel: the layout pays where a weight has fewer chunks than mask bytes / this.
Measured with ``benchmarks/isa_layers.py --gather --threads 1`` (AVX2 build, AMD EPYC Zen 5 VM, random masks,
out of cache; gathered time / bitmask time): 50% sparse 1.03x (~0.53 chunks per mask byte), 60% 0.91x, 70%
0.79x."""


def bitmask_gather(
    bits: torch.Tensor, rows: int, in_features: int, force: bool = False
) -> torch.Tensor | None:
    """The batch-1 gathered layout of a bitmask weight (op ``bitmask_gather``, the C source's ``bm_gather``):
    an int64 tensor of ``rows + 1`` chunk offsets then the chunks (up to eight kept columns within sixteen,
    their 4-bit offsets, first column and count in one uint64 each), or ``None`` where the layout does not
    apply (fewer than 16 or 2^24 and more columns, no kernel) or, unless ``force``, would not be faster than
    the bitmask kernel (:data:`GATHER_CHUNK_GROUPS`)."""
    lib = _native.load()
    if lib is None or rows == 0 or not 16 <= in_features < 1 << 24:
        return None
    bits = bits.contiguous()
    cp = torch.empty(rows + 1, dtype=torch.int64)
    n = lib.hfs_bm_gather(rows, in_features, bits.data_ptr(), cp.data_ptr(), None)
    if n < 0 or not (force or n * GATHER_CHUNK_GROUPS < rows * ((in_features + 7) // 8)):
        return None
    out = torch.empty(rows + 1 + n, dtype=torch.int64)
    lib.hfs_bm_gather(rows, in_features, bits.data_ptr(), out.data_ptr(), out[rows + 1 :].data_ptr())
    return out


@register_backend
class BitmaskBackend(_PackedBackend):
    """1 bit per weight + packed kept values (fp32 or bf16). Any unstructured mask, CPU.

    ``layout``: the batch-1 product's layout with float32 activations (the bits, row offsets and values are
    what is stored either way). ``"mask"``: the bitmask kernel (one lane expansion per eight columns);
    ``"gather"``: the kept values in chunks of up to eight within sixteen columns, each chunk's activations
    gathered by its stored 4-bit column offsets (:func:`bitmask_gather`: made from the bits when the
    weight is packed or loaded, never saved; 8 bytes per chunk in memory); ``"auto"`` (default): gather on an
    AVX2 build (:data:`GATHER_ISAS`) where the weight has few enough chunks to be faster
    (:data:`GATHER_CHUNK_GROUPS`: from about 55% sparsity), else mask. Layers narrower than 16 columns
    and int8 activations keep the mask."""

    name = "bitmask"
    op = "bitmask"
    capabilities = packed_capabilities(
        "1-bit mask + packed values (fp32 / bf16, or int8 with row scales); native kernels"
    )

    def _pack(self, w: torch.Tensor, m: torch.Tensor) -> None:
        layout = self.options.get("layout", "auto")
        if layout not in LAYOUTS:
            raise SparsityError(f"{self.name}: layout must be one of {', '.join(LAYOUTS)}, not {layout!r}.")
        self.layout = layout
        self.bits = _pack_bits(m).contiguous()
        counts = m.sum(1, dtype=torch.int64)
        self.rowptr = torch.zeros(self.out_features + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=self.rowptr[1:])
        # the kernels read 16 values, or 64 int8 codes, at a time
        self.values = self._store(w[m], 64 if self.int8 else 16)

    _TENSORS = ("bits", "rowptr", "values")

    def _bind(self) -> None:
        super()._bind()
        self.gather = None  # the batch-1 gathered layout (see the class), rebuilt from the bits
        layout = getattr(self, "layout", "auto")
        if self.kernel != "native" or self.int8_activations or layout == "mask":
            return
        if layout == "gather" or _native.isa() in GATHER_ISAS:
            self.gather = bitmask_gather(
                self.bits, self.out_features, self.in_features, force=layout == "gather"
            )

    def __getstate__(self):
        state = super().__getstate__()
        state["gather"] = None  # rebuilt from the bits (_bind)
        return state

    @property
    def storage_bytes(self) -> int:
        """Bytes of the stored tensors, and of the gathered layout where the batch-1 product uses one."""
        gather = getattr(self, "gather", None)
        extra = 0 if gather is None else gather.numel() * gather.element_size()
        return super().storage_bytes + extra

    def _batch1_operands(self):
        if self.gather is not None:
            return "bitmask_gather", self.gather, self.rowptr
        return super()._batch1_operands()

    def _native_mm(self, x2d, bias):
        gather = self.gather is not None and x2d.shape[0] == 1 and not self.int8_activations
        return _native.run_op(
            "bitmask_gather" if gather else "bitmask", self.out_features, self.in_features, x2d, self.values,
            self.gather if gather else self.bits, self.rowptr, bias, self._threads(x2d.shape[0]),
            int8_activations=self.int8_activations,
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
