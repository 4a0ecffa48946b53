"""The table of registered backends: normalized name -> class, and the aliases.

Written only by :func:`hf_sparsity.backends.registry.register_backend`; read by the registry's
lookups and by :meth:`~hf_sparsity.backends.base.SparseBackend.from_dense`'s error messages
(which registered backends would take the weight). It imports nothing of the package, so
``base`` and ``registry`` both import it and not each other.
"""

from __future__ import annotations

from typing import Any

import torch

BACKENDS: dict[str, Any] = {}
"""Registry key -> backend class (a :class:`~hf_sparsity.backends.base.SparseBackend` subclass)."""
ALIASES: dict[str, str] = {}
"""Alias -> registry key."""


def alternatives(device_type: str, dtype: torch.dtype) -> str:
    """Registered backends that run on ``device_type`` with ``dtype`` (for error messages)."""
    names = [
        n
        for n, k in sorted(BACKENDS.items())
        if device_type in k.capabilities.devices and dtype in k.capabilities.dtypes and n != "emulator"
    ]
    return ", ".join(names) or "none registered"


def int8_backends() -> str:
    """Registered backends that store int8 values (for error messages)."""
    return ", ".join(n for n, k in sorted(BACKENDS.items()) if k.capabilities.int8_values) or "none"
