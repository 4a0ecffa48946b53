"""One contiguous, huge-page-backed buffer for a model's packed weights.

A decoded token reads every packed weight once, layer after layer. Held as hundreds of separate tensors on
4 KiB pages, that read takes a TLB miss every 4 KiB and the hardware prefetchers stop at every page
boundary, so each core streams well below what memory delivers. :func:`pack_weights` copies the packed
tensors of every native format (``bitmask``, ``nm24``, ``native_dense``, and the decode format of
``auto``) into one buffer, in module order (the order a token reads them), on an anonymous mapping that
asks the kernel for transparent huge pages (``madvise(MADV_HUGEPAGE)``), and points the backends at views
of it. :func:`~hf_sparsity.inference.sparsify_for_inference` calls it after converting a model.

What it buys is measured in ``docs/results/backends.md`` (decoding with and without it). Where
transparent huge pages are disabled, or on a platform without ``madvise``, the buffer is ordinary memory
and the weights are still contiguous.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from collections.abc import Iterable

import torch
from torch import nn

from .formats import _PackedBackend

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_ALIGN = 64  # each tensor starts on a cache line (the kernels' vector loads)


def huge_buffer(nbytes: int) -> torch.Tensor:
    """A zeroed uint8 tensor of ``nbytes`` starting on a 2 MiB boundary, on an anonymous mapping advised
    for transparent huge pages (ordinary memory where the platform has no such advice). The mapping lives
    as long as the tensor or a view of it."""
    size = max(int(nbytes), 1) + HUGE_PAGE
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    buf = mmap.mmap(-1, size, flags=flags) if flags else mmap.mmap(-1, size)  # (Windows: no flags)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None and hasattr(buf, "madvise"):
        try:
            buf.madvise(advice)
        except OSError:  # THP unsupported by this kernel: ordinary pages
            pass
    start = (-torch.frombuffer(buf, dtype=torch.uint8, count=1).data_ptr()) % HUGE_PAGE
    # a storage of exactly nbytes (what resident-memory counts see); it holds a reference to the mapping,
    # whose slack before and after is never touched, so never backed by memory
    return torch.frombuffer(buf, dtype=torch.uint8, count=max(int(nbytes), 1), offset=start)[: int(nbytes)]


def _packed_backends(model: nn.Module) -> list:
    """The native packed backends of ``model``'s converted layers, in module order, each once."""
    found, seen = [], set()
    for m in model.modules():
        b = getattr(m, "backend", None)
        b = getattr(b, "decode", b)  # auto: the format its decoding runs on
        if isinstance(b, _PackedBackend) and b.kernel == "native" and id(b) not in seen:
            seen.add(id(b))
            found.append(b)
    return found


def _span(tensors: Iterable[torch.Tensor]) -> int:
    return sum(-(-t.numel() * t.element_size() // _ALIGN) * _ALIGN for t in tensors)


def pack_weights(model: nn.Module) -> int:
    """Move the packed weights of ``model``'s native layers into one huge-page buffer (see the module
    docstring); returns the bytes moved (0 when there is nothing to move). A packed tensor that is also a
    parameter or buffer of the model, or of a dense module a converted layer keeps (an fp32 LM head on
    ``native_dense`` runs on the head's own weight, which may be tied to the input embedding), moves with
    them: they become views of the same place, so nothing is held twice; where they share its memory
    only in part, it stays. Values and outputs are unchanged; calling it again repacks into a fresh
    buffer."""
    held = [*model.parameters(), *model.buffers()]
    for m in model.modules():  # dense originals a converted layer keeps for restore_dense
        original = (getattr(m, "_original", None) or [None])[0]
        if isinstance(original, nn.Module):
            held += [*original.parameters(), *original.buffers()]
    return pack_backends(_packed_backends(model), held=held)


def pack_backends(backends: list, held: Iterable[torch.Tensor] = ()) -> int:
    """:func:`pack_weights` for a list of packed backends (their tensors in list order); ``held``: other
    tensors that may share their memory (moved along as views, or keeping a tensor in place)."""
    holders: dict[int, list[torch.Tensor]] = {}
    for h in held:
        group = holders.setdefault(h.untyped_storage().data_ptr(), [])
        if not any(h is g for g in group):
            group.append(h)

    def same(h: torch.Tensor, t: torch.Tensor) -> bool:
        return (
            h.data_ptr() == t.data_ptr() and h.shape == t.shape and h.dtype == t.dtype and h.is_contiguous()
        )

    def movable(t: torch.Tensor) -> bool:
        return all(same(h, t) for h in holders.get(t.untyped_storage().data_ptr(), ()))

    total = sum(_span(t for t in b.storage_tensors() if movable(t)) for b in backends)
    if total == 0:
        return 0
    try:
        arena = huge_buffer(total)
    except (OSError, ValueError, OverflowError) as e:  # packing only speeds reading up: keep the tensors
        logger.warning("The packed weights stay where they are: no buffer of %d bytes (%s).", total, e)
        return 0
    offset = 0

    def place(t: torch.Tensor) -> torch.Tensor:
        nonlocal offset
        if not movable(t):
            return t
        n = t.numel() * t.element_size()
        view = arena[offset : offset + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        offset += -(-n // _ALIGN) * _ALIGN
        for h in holders.get(t.untyped_storage().data_ptr(), ()):
            h.data = view  # a parameter / buffer sharing it: the same memory still
        return view

    with torch.no_grad():
        for b in backends:
            b._place(place)
    _trim_heap()
    return total


def _trim_heap() -> None:
    """Give the heap's free memory back to the system (glibc ``malloc_trim``). The tensors just copied
    out were mostly below malloc's mmap threshold, so freeing them leaves their pages to the process. In
    ``benchmarks/decode.py`` on the 1B shape (four converted copies of the model in one process), memory
    in use while decoding was 19-20 GB without the trim and 15 GB with it: the 4 GB went back to the file
    cache, which llama.cpp's memory-mapped GGUF rows of the same run need."""
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the process's own C library
    except (OSError, AttributeError, TypeError):  # not glibc
        return
    trim(0)
