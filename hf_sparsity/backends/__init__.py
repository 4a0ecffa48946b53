"""Pluggable sparse compute backends and their registry.

Built in:

* ``masked_dense`` - dense matmul on ``W * mask``; any device and dtype; the training default.
* ``csr`` - compressed sparse rows for inference: a native row-parallel kernel with
  16-bit column indices for batch-1 decoding on CPU, torch.sparse CSR elsewhere.
* ``semi_structured`` - 2:4 sparsity through torch's semi-structured tensors (CUDA, Ampere+).
* ``bitmask`` - 1 bit per weight + packed values (fp32 / bf16), native AVX2 kernels on CPU:
  the format for 50-75% sparsity.
* ``nm24`` - 2:4 on CPU: packed values + 2-bit positions, native AVX2 kernels.
* ``native_dense`` - dense weight, native multi-threaded GEMV (LM heads, dense-winning layers).
* ``auto`` - per layer, the fastest of dense and the sparse formats, measured at conversion,
  separately for decoding (batch 1) and prefill; never slower than dense.
* ``emulator`` - a reference model of a sparsity-accelerating dataflow machine: exact,
  one AXPY per nonzero weight, with work counters and a cycle model. Every other
  backend is tested against it.

Register your own with :func:`register_backend`. Importing this package never
initializes CUDA nor compiles anything.
"""

from __future__ import annotations

import re

from ..utils import SparsityError
from . import ops  # noqa: F401  (registers the torch.ops.hf_sparsity custom ops; compiles nothing)
from .base import PHASES, BackendCapabilities, SparseBackend, WorkCounters, check_nm

_REGISTRY: dict[str, type[SparseBackend]] = {}
_ALIASES: dict[str, str] = {}


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
            if k in _REGISTRY or k in _ALIASES:
                owner = _REGISTRY.get(k) or _REGISTRY[_ALIASES[k]]
                raise SparsityError(
                    f"Backend name {k!r} is already registered (by {owner.__name__}); choose another name."
                )
        if not klass.name:
            klass.name = key
        _REGISTRY[key] = klass
        for k in keys[1:]:
            _ALIASES[k] = key
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
        key = _ALIASES.get(key, key)
        if key not in _REGISTRY:
            raise SparsityError(
                f"Unknown sparse backend {name!r}. Registered: {', '.join(sorted(_REGISTRY))}."
            )
        klass = _REGISTRY[key]
    if check_available:
        reason = klass.unavailable_reason()
        if reason is not None:
            raise SparsityError(f"Backend {klass.name!r} is not available on this machine: {reason}")
    return klass


def available_backends(all: bool = False) -> list[str]:
    """Names of the registered backends that can run here (every registered one with ``all=True``)."""
    return sorted(n for n, k in _REGISTRY.items() if all or k.is_available())


def backend_table() -> list[dict]:
    """One row per registered backend: name, available, why not, capabilities."""
    rows = []
    for n in sorted(_REGISTRY):
        k = _REGISTRY[n]
        reason = k.unavailable_reason()
        rows.append({"name": n, "available": reason is None, "reason": reason, **k.capabilities.to_dict()})
    return rows


from .auto import AutoBackend  # noqa: E402
from .csr import CSRBackend  # noqa: E402
from .emulator import EmulatorBackend, MachineSpec  # noqa: E402
from .formats import BitmaskBackend, NativeDenseBackend, NM24Backend  # noqa: E402
from .masked_dense import MaskedDenseBackend  # noqa: E402
from .semi_structured import SemiStructuredBackend  # noqa: E402

for _klass in (
    MaskedDenseBackend,
    CSRBackend,
    SemiStructuredBackend,
    EmulatorBackend,
    BitmaskBackend,
    NM24Backend,
    NativeDenseBackend,
    AutoBackend,
):
    register_backend(_klass)

__all__ = [
    "PHASES",
    "AutoBackend",
    "BackendCapabilities",
    "BitmaskBackend",
    "CSRBackend",
    "EmulatorBackend",
    "MachineSpec",
    "MaskedDenseBackend",
    "NM24Backend",
    "NativeDenseBackend",
    "SemiStructuredBackend",
    "SparseBackend",
    "WorkCounters",
    "available_backends",
    "backend_table",
    "check_nm",
    "get_backend",
    "normalize_name",
    "register_backend",
]
