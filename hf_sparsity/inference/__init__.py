"""Inference: a pruned model's sparse layers on a packed backend, decoded fast.

* :mod:`~hf_sparsity.inference.conversion`: :func:`sparsify_for_inference` and :func:`restore_dense`
  (the sparse layer :class:`SparseLinear` swapped in for the targeted ``nn.Linear`` / ``Conv1D`` and
  back; :class:`Int8Embedding` for the input embedding tied to an int8 LM head), and what reports on
  the converted model (:func:`auto_report`, :func:`sparse_layer_bytes`, ...);
* :mod:`~hf_sparsity.inference.decoding`: batch-1 generation: the native step behind
  ``model.generate(custom_generate=native_generate)`` and :func:`greedy_decode`;
* :mod:`~hf_sparsity.inference.bench`: the timing harness behind ``hf_sparsity bench`` and
  ``benchmarks/`` (the library itself never imports it).

The conversion's names are on this package too (``from hf_sparsity.inference import
sparsify_for_inference``).
"""

from . import decoding  # noqa: F401  (registers greedy_decode for auto's whole-model check)
from .conversion import (
    Int8Embedding,
    SparseLinear,
    auto_choices,
    auto_report,
    compiled_generate_kwargs,
    resident_weight_bytes,
    resolve_masks,
    restore_dense,
    sparse_layer_bytes,
    sparse_layers,
    sparsify_for_inference,
)

__all__ = [
    "Int8Embedding",
    "SparseLinear",
    "auto_choices",
    "auto_report",
    "compiled_generate_kwargs",
    "resident_weight_bytes",
    "resolve_masks",
    "restore_dense",
    "sparse_layer_bytes",
    "sparse_layers",
    "sparsify_for_inference",
]
