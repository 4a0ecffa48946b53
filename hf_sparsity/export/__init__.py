"""What leaves a training run for the Hub: conversions of a folder and the card that describes it.

* :mod:`~hf_sparsity.export.finalize`: conversions: finalize (masks baked into zeros), Cerebras
  NaN sentinels.
* :mod:`~hf_sparsity.export.model_card`: the Hub card of a finalized folder.
* :mod:`~hf_sparsity.export.merge`: :func:`merge_sparse`, merging a LoRA adapter into a sparse
  base with its masks kept exact.

These present what the layers below made (masks on disk, evaluation reports, FLOP counts), so
they sit above storage and evaluation; nothing below imports them. Import the module you need;
the public entry points are also on the package root.
"""
