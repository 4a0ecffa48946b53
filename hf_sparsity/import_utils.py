"""Availability probes for optional backends and tools, in one place (peft-style).

Every probe is cheap and side-effect free: none of them initializes CUDA, imports a
heavy optional package more than once, or compiles anything.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil

import torch


@functools.cache
def is_scipy_available() -> bool:
    """True when ``scipy`` can be imported."""
    return importlib.util.find_spec("scipy") is not None


def is_cuda_available() -> bool:
    """True when a CUDA device is visible. Does not initialize the CUDA context."""
    return torch.cuda.is_available()


def semi_structured_unavailable_reason() -> str | None:
    """Why torch's 2:4 semi-structured sparsity cannot run here, or ``None`` when it can.

    Needs a CUDA GPU of compute capability 8.0 or newer (Ampere+) and
    ``torch.sparse.to_sparse_semi_structured``. Querying the capability initializes
    CUDA, so this is only called when the backend is actually requested.
    """
    if not hasattr(torch.sparse, "to_sparse_semi_structured"):
        return (
            f"torch {torch.__version__} has no torch.sparse.to_sparse_semi_structured (needs torch >= 2.1)."
        )
    if not torch.cuda.is_available():
        return "2:4 semi-structured sparsity needs a CUDA GPU; none is visible (CPU-only torch or no device)."
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return f"2:4 semi-structured sparsity needs compute capability >= 8.0; this GPU has {major}.{minor}."
    return None


def is_semi_structured_available() -> bool:
    """True when the ``semi_structured`` (2:4) backend can run on this machine."""
    return semi_structured_unavailable_reason() is None


def c_compiler() -> str | None:
    """Path of the C compiler used for the native decode kernel (``$CC``, ``cc``, ``gcc``), or ``None``.

    ``HF_SPARSITY_NO_NATIVE=1`` disables the native kernel entirely.
    """
    if os.environ.get("HF_SPARSITY_NO_NATIVE", "") not in ("", "0"):
        return None
    for cand in (os.environ.get("CC"), "cc", "gcc"):
        if cand and shutil.which(cand):
            return shutil.which(cand)
    return None
