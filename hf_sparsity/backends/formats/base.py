"""The shared base of the packed formats (:class:`_PackedBackend`): packed storage, no dense copy kept,
native / torch dispatch, int8 values, prefill through a reused scratch buffer; and the bit packing."""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from ...utils import SparsityError
from .. import _native, ops
from ..base import BackendCapabilities, SparseBackend
from .quant import quantize_activations, quantize_rows

SMALL_BATCH = 16
"""Rows of ``x`` up to which the native kernels run; above, a dense GEMM on the unpacked weight."""


_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


_scratch = threading.local()


def scratch_buffer(rows: int, cols: int) -> torch.Tensor:
    """A float32 ``[rows, cols]`` buffer reused per thread and shape: where prefill unpacks a packed
    weight for one dense GEMM. A fresh tensor of that size would be new pages from the OS on every
    call (the page faults cost about as much as the unpack itself); this one stays mapped. One buffer
    per distinct layer shape (SmolLM2-135M: 4 shapes, 8.8 MB)."""
    bufs = _scratch.__dict__.setdefault("bufs", {})
    buf = bufs.get((rows, cols))
    if buf is None:
        with torch.inference_mode(
            False
        ):  # a normal tensor: usable (and writable) in and out of inference mode
            buf = bufs[(rows, cols)] = torch.empty(rows, cols, dtype=torch.float32)
    return buf


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """uint8 ``[out, ceil(in/8)]``: bit ``i`` of byte ``g`` is ``mask[:, 8g + i]``."""
    out_f, in_f = mask.shape
    pad = (-in_f) % 8
    m = F.pad(mask.to(torch.uint8), (0, pad)).view(out_f, -1, 8)
    return (m * _BITS).sum(-1, dtype=torch.int32).to(torch.uint8)


def _unpack_bits(bits: torch.Tensor, in_f: int) -> torch.Tensor:
    """Bool ``[out, in]`` from :func:`_pack_bits`."""
    return ((bits.unsqueeze(-1) & _BITS) != 0).reshape(bits.shape[0], -1)[:, :in_f]


def packed_capabilities(description: str, **more) -> BackendCapabilities:
    """What every packed format can do: CPU, fp32 / bf16 (or int8) values, inference only, no dense copy."""
    return BackendCapabilities(
        devices=("cpu",),
        dtypes=(torch.float32, torch.bfloat16),
        training=False,
        frees_dense=True,
        int8_values=True,
        description=description,
        **more,
    )


class _PackedBackend(SparseBackend):
    """Shared machinery: packed storage, dropped dense tensors, native / torch dispatch."""

    capabilities = BackendCapabilities(devices=("cpu",), dtypes=(torch.float32, torch.bfloat16))
    op = ""

    def __init__(self, weight: torch.Tensor, mask: torch.Tensor, **options):
        self._tmp = (weight, mask)
        super().__init__(weight, mask, **options)
        del self._tmp  # the dense weight and mask are not kept

    # weight / mask: set once by SparseBackend.__init__, rebuilt from the packed form afterwards
    @property
    def weight(self) -> torch.Tensor:
        return self.to_dense()

    @weight.setter
    def weight(self, value) -> None:
        self.dtype = value.dtype
        self.device = value.device

    @property
    def mask(self) -> torch.Tensor:
        if hasattr(self, "_tmp"):
            return self._tmp[1]
        return self._dense_mask()

    @mask.setter
    def mask(self, value) -> None:
        if hasattr(self, "_tmp"):
            self._tmp = (self._tmp[0], value)

    def _prepare(self) -> None:
        prefill = self.options.get("prefill", "unpack")
        if prefill not in ("unpack", "native"):
            raise SparsityError(f"{self.name}: prefill must be 'unpack' or 'native', not {prefill!r}.")
        kernel = self.options.get("kernel", "auto")
        if kernel not in ("auto", "native", "torch"):
            raise SparsityError(f"{self.name}: unknown kernel {kernel!r}; use auto, native or torch.")
        if kernel == "native" and _native.load() is None:
            raise SparsityError(f"{self.name}: the native kernel is unavailable here: {_native.error()}")
        self.kernel = "native" if kernel != "torch" and _native.load() is not None else "torch"
        self.threads = self.options.get("threads")
        w, m = self._tmp
        w, m = w.detach(), m.bool()
        self.int8 = self.options.get("values") == "int8"
        activations = self.options.get("activations")
        if activations not in (None, "int8", "float32"):
            raise SparsityError(f"{self.name}: activations must be 'int8' or 'float32', not {activations!r}.")
        if activations and not self.int8:
            raise SparsityError(
                f"{self.name}: activations={activations!r} goes with values='int8' (int8 weight codes); "
                "leave it unset for float weights."
            )
        # int8 values multiply int8 activations (32 scales per row) unless asked for float32 ones
        self.int8_activations = self.int8 and activations != "float32"
        if self.int8:  # pack the int8 codes; the kernels apply the row scales
            self.scales, w = quantize_rows(w * m)
        self._pack(w, m)
        self._bind()

    def _bind(self) -> None:
        if self.int8:  # a view of the scales inside the values buffer (no second copy)
            sb = _native.scale_bytes(self.out_features)
            self.scales = self.values[:sb].view(torch.float32)[: self.out_features]
        self._batch1 = None  # the batch-1 call's fixed arguments, built on first use (see linear)

    _TENSORS: tuple[str, ...] = ()
    """The attributes holding the packed tensors, in :meth:`storage_tensors` order."""

    def _tensors(self):
        return tuple(getattr(self, a) for a in self._TENSORS)

    def _place(self, place) -> None:
        """Keep ``place(t)`` (a copy of ``t`` elsewhere) for each packed tensor ``t``: see
        :func:`hf_sparsity.backends.arena.pack_weights`."""
        for a in self._TENSORS:
            setattr(self, a, place(getattr(self, a)))
        self._bind()

    def __getstate__(self):
        # copies and pickles rebuild the batch-1 call (it holds raw pointers) and the scales' view; each
        # packed tensor goes out on its own (torch.save refuses views of one buffer as different dtypes,
        # as the huge-page buffer of arena.pack_weights holds them)
        state = self.__dict__.copy()
        state["_batch1"] = None
        state.pop("scales", None)
        for a in self._TENSORS:
            if a in state:
                state[a] = state[a].clone()
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._bind()

    def refresh(self) -> None:
        raise SparsityError(
            f"{self.name} keeps no dense weight to re-read; build a new backend with from_dense(weight, "
            "mask)."
        )

    def _store(self, vals: torch.Tensor, pad: int) -> torch.Tensor:
        """The kernels' values tensor from the kept values in order, with ``pad`` zeros after (the kernels
        read whole vectors): in the values' dtype, or, with int8 values, one int8 buffer holding the rows'
        float32 scales (padded to 64 bytes) and then the codes."""
        n = vals.numel()
        if not self.int8:
            out = torch.zeros(n + pad, dtype=self.dtype)
            out[:n] = vals.reshape(-1)
            return out
        sb = _native.scale_bytes(self.out_features)
        out = torch.zeros(sb + n + pad, dtype=torch.int8)
        out[:sb].view(torch.float32)[: self.out_features] = self.scales
        out[sb : sb + n] = vals.reshape(-1)
        return out

    def _codes(self) -> torch.Tensor:
        """The stored values (int8 codes without their scales) as float32, padding included."""
        if not self.int8:
            return self.values.float()
        return self.values[_native.scale_bytes(self.out_features) :].float()

    def _scaled(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` ``[rows, in]`` built from :meth:`_codes`, times the row scales (int8 values)."""
        return out.mul_(self.scales[:, None]) if self.int8 else out

    @property
    def values_bytes(self) -> int:
        """Bytes of the stored values (with int8 values: the codes and their row scales)."""
        return self.values.numel() * self.values.element_size()

    @property
    def storage_bytes(self) -> int:
        """Bytes of every tensor the packed weight holds (values, bitmask / positions, row offsets)."""
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def storage_tensors(self) -> list[torch.Tensor]:
        return list(self._tensors())

    @property
    def index_bytes(self) -> int:
        return self.storage_bytes - self.values_bytes

    # ------------------------------------------------------------------ compute
    def _batch1_call(self):
        """``(the kernel call's prepared fixed arguments, their address, threads)``: the decode fast path.
        The structure holds raw pointers into this backend's tensors (rebuilt on copy)."""
        op, meta, rowptr = self._batch1_operands()
        nt = self._threads(1)
        prep, addr = _native.prepared_call((
            _native.OPS[op], self.out_features, self.in_features, nt,
            None if rowptr is None else rowptr.data_ptr(), None if meta is None else meta.data_ptr(),
            self.values.data_ptr(), 3 if self.int8_activations else _native.vtype(self.values),
        ))  # fmt: skip
        return prep, addr, torch.get_num_threads()

    def _batch1_operands(self):
        """``(op, meta, rowptr)`` of the batch-1 kernel call (formats with a layout of their own for it
        override this)."""
        t = self._tensors()
        meta, rowptr = (t[0], t[1]) if self.op == "bitmask" else (t[0] if self.op == "nm24" else None, None)
        return self.op, meta, rowptr

    def decode_call(self):
        if self.kernel != "native":
            return None
        prep, addr, _ = self._batch1_call()
        return prep, addr

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # decode fast path (one fp32 row, no autograd, eager): the kernel call with its fixed arguments
        # prepared once; ~5 us less Python per call than the general path (x ~200 layers per token)
        if (
            x.shape[-1] == self.in_features
            and self.kernel == "native"
            and _native.decode_row(x, bias)
            and not (
                torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))
            )
            and not torch.compiler.is_compiling()
        ):
            call = self._batch1
            if call is None or call[2] != torch.get_num_threads():
                call = self._batch1 = self._batch1_call()
            y = torch.empty(*x.shape[:-1], self.out_features, dtype=torch.float32)
            c = self.counters["forward"]
            c.calls += 1
            c.macs += self.nnz
            c.macs_skipped += self.out_features * self.in_features - self.nnz
            _native._lib.hfs_run_prepared(
                call[1], x.data_ptr(), y.data_ptr(), None if bias is None else bias.data_ptr()
            )
            return y
        if x.shape[-1] != self.in_features:
            raise SparsityError(
                f"Input has {x.shape[-1]} features; the sparse weight expects {self.in_features}."
            )
        if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
            # autograd for x (and bias); with int8 activations, the same ones dequantized (straight through)
            return F.linear(self.product_input(x), self.to_dense().to(x.dtype), bias)
        lead = x.shape[:-1]
        batch = x.numel() // max(self.in_features, 1)
        native_batch = batch <= SMALL_BATCH or self.options.get("prefill") == "native"
        eager_native = self.kernel == "native" and native_batch and not torch.compiler.is_compiling()
        if not eager_native:  # the native kernel quantizes int8 activations itself (value type 3)
            x = self.product_input(x)
        x2d = x.reshape(-1, self.in_features)
        if torch.compiler.is_compiling() and self.kernel == "native":  # custom ops: no graph break
            if not native_batch:
                return F.linear(x, self.dense_for_matmul().to(x.dtype), bias)
            t = self._tensors()
            meta, rowptr = (
                (t[0], t[1]) if self.op == "bitmask" else (t[0] if self.op == "nm24" else None, None)
            )
            return ops.linear_op("packed_linear")(
                x,
                self.values,
                meta,
                rowptr,
                bias,
                self.op,
                self.out_features,
                self._work_per_row,
                self.threads or 0,
            )
        self._count("forward", batch)
        if self.kernel == "native" and native_batch:
            if x2d.dtype != torch.float32 or not x2d.is_contiguous():
                x2d = x2d.float().contiguous()
            y = self._native_mm(x2d, bias)
            if x.dtype != torch.float32:
                y = y.to(x.dtype)
        else:
            y = F.linear(x2d, self.dense_for_matmul().to(x2d.dtype), bias)
        return y.view(*lead, self.out_features)

    def product_input(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as this backend's products see it: with int8 activations, :func:`quantize_activations`
        (gradients pass straight through); else ``x``. For a product computed outside :meth:`linear`
        (a GEMM on :meth:`dense_for_matmul`)."""
        if not self.int8_activations:
            return x
        xq = quantize_activations(x.detach()).to(x.dtype)
        return x + (xq - x).detach() if x.requires_grad else xq

    def dense_for_matmul(self) -> torch.Tensor:
        """The dense weight for one GEMM (prefill), without autograd: with the native kernel, unpacked
        into a per-thread buffer reused across calls (:func:`scratch_buffer`), valid until the next
        call for this shape on this thread; under ``torch.compile``, a fresh tensor from the
        ``hf_sparsity::packed_unpack`` custom op. Use :meth:`to_dense` for a tensor to keep."""
        if self.op == "gemv" or self.kernel != "native" or not self.out_features * self.in_features:
            return self.to_dense()
        t = self._tensors()
        meta, rowptr = (t[0], t[1]) if self.op == "bitmask" else (t[0], None)
        if torch.compiler.is_compiling():
            return torch.ops.hf_sparsity.packed_unpack(
                self.values, meta, rowptr, f"{self.op}_unpack", self.out_features, self.in_features,
                self.threads or 0,
            )  # fmt: skip
        threads = _native.threads_for(self.out_features * self.in_features // 4, self.threads)
        buf = scratch_buffer(self.out_features, self.in_features)
        return _native.run_op(
            f"{self.op}_unpack", self.out_features, self.in_features, None, self.values, meta, rowptr,
            None, threads, out=buf,
        )  # fmt: skip

    __call__ = linear

    def _forward(self, x2d: torch.Tensor) -> torch.Tensor:
        return self.linear(x2d)

    def _threads(self, batch: int) -> int:
        return _native.threads_for(self._work_per_row * batch, self.threads)

    @property
    def _work_per_row(self) -> int:
        return self.out_features * self.in_features if self.op == "gemv" else self.nnz

    def _count(self, phase: str, batch: int) -> None:  # without rebuilding the dense mask
        c = self.counters[phase]
        c.calls += 1
        c.macs += self.nnz * batch
        c.macs_skipped += (self.out_features * self.in_features - self.nnz) * batch

    def to_dense(self) -> torch.Tensor:
        """The masked dense weight ``[out, in]`` in the values' dtype (rebuilt; nothing dense is kept)."""
        return self._unpack().to(self.dtype)
