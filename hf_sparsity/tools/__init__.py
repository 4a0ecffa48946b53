"""The old home of the benchmark harness: :mod:`hf_sparsity.tools.bench` is now
:mod:`hf_sparsity.inference.bench` (this path still imports, with a DeprecationWarning)."""
