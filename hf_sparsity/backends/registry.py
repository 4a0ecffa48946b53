"""The backend registry: names (normalized, with aliases) -> :class:`SparseBackend` classes.

Backends register where they are defined, with the :func:`register_backend` decorator; importing
:mod:`hf_sparsity.backends` imports every built-in backend module, which registers it. The table
itself is :mod:`hf_sparsity.backends.table` (``base`` reads it for its error messages).
"""

from __future__ import annotations

import re

from ..utils import SparsityError
from .base import SparseBackend
from .table import ALIASES, BACKENDS, alternatives, int8_backends  # noqa: F401  (re-exported)


def normalize_name(name: str) -> str:
    """Registry key: lower case, ``-`` / spaces / dots become ``_`` (``"Masked-Dense"`` ->
    ``"masked_dense"``)."""
    if not isinstance(name, str) or not name.strip():
        raise SparsityError(f"A backend name must be a non-empty string, got {name!r}.")
    return re.sub(r"[\s\-.]+", "_", name.strip().lower())


def register_backend(cls: type[SparseBackend] | None = None, *, name: str | None = None, aliases=()):
    """Register a :class:`SparseBackend` subclass under its (normalized) name and aliases.

    Usable as ``register_backend(MyBackend)`` or as a decorator. Refuses a name or alias
    that is already taken.
    """

    def _register(klass: type[SparseBackend]) -> type[SparseBackend]:
        if not (isinstance(klass, type) and issubclass(klass, SparseBackend)):
            raise SparsityError(f"{klass!r} is not a SparseBackend subclass.")
        key = normalize_name(name or klass.name)
        keys = [key] + [normalize_name(a) for a in (tuple(aliases) or tuple(klass.aliases))]
        for k in keys:
            if k in BACKENDS or k in ALIASES:
                owner = BACKENDS.get(k) or BACKENDS[ALIASES[k]]
                raise SparsityError(
                    f"Backend name {k!r} is already registered (by {owner.__name__}); choose another name."
                )
        if not klass.name:
            klass.name = key
        BACKENDS[key] = klass
        for k in keys[1:]:
            ALIASES[k] = key
        return klass

    return _register(cls) if cls is not None else _register


def get_backend(name: str, *, check_available: bool = True) -> type[SparseBackend]:
    """The backend class registered as ``name`` (or an alias).

    With ``check_available`` (default), raise a clear error when it cannot run here
    (e.g. ``semi_structured`` without a CUDA GPU).
    """
    if isinstance(name, type) and issubclass(name, SparseBackend):
        klass = name
    else:
        key = normalize_name(name)
        key = ALIASES.get(key, key)
        if key not in BACKENDS:
            raise SparsityError(
                f"Unknown sparse backend {name!r}. Registered: {', '.join(sorted(BACKENDS))}."
            )
        klass = BACKENDS[key]
    if check_available:
        reason = klass.unavailable_reason()
        if reason is not None:
            raise SparsityError(f"Backend {klass.name!r} is not available on this machine: {reason}")
    return klass


def available_backends(all: bool = False) -> list[str]:
    """Names of the registered backends that can run here (every registered one with ``all=True``)."""
    return sorted(n for n, k in BACKENDS.items() if all or k.is_available())


def backend_table() -> list[dict]:
    """One row per registered backend: name, available, why not, capabilities."""
    rows = []
    for n in sorted(BACKENDS):
        k = BACKENDS[n]
        reason = k.unavailable_reason()
        rows.append({"name": n, "available": reason is None, "reason": reason, **k.capabilities.to_dict()})
    return rows
