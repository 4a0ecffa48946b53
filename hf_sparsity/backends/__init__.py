"""Pluggable sparse compute backends and their registry.

Built in:

* ``masked_dense`` - dense matmul on ``W * mask``; any device and dtype; the training default.
* ``csr`` - compressed sparse rows for inference: a native row-parallel kernel with
  16-bit column indices for batch-1 decoding on CPU, torch.sparse CSR elsewhere.
* ``semi_structured`` - 2:4 sparsity through torch's semi-structured tensors (CUDA, Ampere+).
* ``cusparselt`` - 2:4 through cuSPARSELt called directly: compressed once, the algorithm searched once
  per shape (CUDA, Ampere+); ``auto`` on a CUDA model chooses it or dense per layer group.
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

from . import ops  # noqa: F401  (registers the torch.ops.hf_sparsity custom ops; compiles nothing)
from .auto import AutoBackend  # noqa: E402
from .base import PHASES, BackendCapabilities, LayerTarget, ModelPlan, SparseBackend, WorkCounters, check_nm
from .csr import CSRBackend  # noqa: E402
from .cusparselt import CuSparseLtBackend  # noqa: E402
from .emulator import EmulatorBackend, MachineSpec  # noqa: E402
from .formats import BitmaskBackend, NativeDenseBackend, NM24Backend  # noqa: E402

# each module registers its backends where they are defined (@register_backend)
from .masked_dense import MaskedDenseBackend  # noqa: E402, I001
from .registry import available_backends, backend_table, get_backend, normalize_name, register_backend
from .semi_structured import SemiStructuredBackend  # noqa: E402

__all__ = [
    "PHASES",
    "AutoBackend",
    "BackendCapabilities",
    "BitmaskBackend",
    "CSRBackend",
    "CuSparseLtBackend",
    "EmulatorBackend",
    "LayerTarget",
    "MachineSpec",
    "MaskedDenseBackend",
    "ModelPlan",
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
