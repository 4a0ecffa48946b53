"""Tools around the library that the library itself never imports: the benchmark harness behind
``hf_sparsity bench`` and ``benchmarks/``."""
