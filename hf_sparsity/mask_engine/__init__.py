"""The mask engine (the package's second floor): masks for one model under one sparsity config, no Trainer.

* :mod:`~hf_sparsity.mask_engine.config`: :class:`SparsityConfig`, the Cerebras ``sparsity:`` section,
  checked, round-tripped;
* :mod:`~hf_sparsity.mask_engine.schedules`: prune / regrow / densify / rewind schedules, compiled against
  the run's length;
* :mod:`~hf_sparsity.mask_engine.targeting`: which parameters are sparsified, at what level, by which rule;
* :mod:`~hf_sparsity.mask_engine.mask_state`: masks, levels, step count and event history;
* :mod:`~hf_sparsity.mask_engine.events`: pure functions, the new masks of an event; the LR rewind;
* :mod:`~hf_sparsity.mask_engine.enforcement`: hooks that keep masked weights, gradients and optimizer
  state at 0;
* :mod:`~hf_sparsity.mask_engine.engine`: :class:`SparsityEngine`, which ties them together.

Nothing is imported here: import the module you need; the public names are on the package root
(``from hf_sparsity import SparsityConfig, SparsityEngine, plan_sparsity``).
"""
