"""The C heap (glibc's malloc): handing freed memory back to the operating system.

Tensors below malloc's mmap threshold come from the heap, which keeps what is freed. Two places
free many of them at once: streaming pruning (block by block) and packing converted layers into
one arena. Both call here. On other C libraries (macOS, musl) there is nothing to do: every function
is then a no-op.
"""

from __future__ import annotations

import ctypes

M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h
MMAP_THRESHOLD = 1 << 20

_LIBC: ctypes.CDLL | bool | None = None


def glibc() -> ctypes.CDLL | None:
    """The process's own C library when it is glibc (has ``malloc_trim`` and ``mallopt``), else ``None``."""
    global _LIBC
    if _LIBC is None:
        try:
            lib = ctypes.CDLL(None)  # the C library already loaded: no lookup by name
            _LIBC = lib if hasattr(lib, "malloc_trim") and hasattr(lib, "mallopt") else False
        except (OSError, TypeError):
            _LIBC = False
    return _LIBC or None


def trim_heap() -> None:
    """Give the heap's free memory back to the system (``malloc_trim(0)``)."""
    lib = glibc()
    if lib is not None:
        lib.malloc_trim(0)


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD) -> None:
    """Serve every allocation of ``threshold`` bytes or more (1 MiB: every tensor that matters) with its
    own ``mmap``, so freeing it hands it straight back to the OS.

    glibc's default threshold is dynamic: each freed mmapped chunk raises it, up to 32 MiB, after
    which tensors below that size come from the heap, where freed ones stay resident. Process-wide
    and kept (glibc has no getter to restore the previous value from); setting it also turns off the
    dynamic adjustment.
    """
    lib = glibc()
    if lib is not None:
        lib.mallopt(M_MMAP_THRESHOLD, threshold)


__all__ = ["MMAP_THRESHOLD", "fix_mmap_threshold", "glibc", "trim_heap"]
