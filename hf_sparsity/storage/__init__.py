"""What a sparse model folder holds on disk, and the conversions between folder kinds.

* :mod:`~hf_sparsity.storage.masks_file`: the mask file (``sparsity_masks.safetensors``): its
  versioned format, written atomically, checked on read; ``load_masks_for`` a model.
* :mod:`~hf_sparsity.storage.folders`: reading model folders shard by shard, per-layer inspection,
  the check that a mask file belongs to the weights beside it.
* :mod:`~hf_sparsity.storage.resume`: which Trainer ``checkpoint-N`` folder is complete and
  resumable.

Storage sits on the ground floor: it imports nothing above it. Finalize and the model card, which
present what the layers above made, live in :mod:`hf_sparsity.export`.

Nothing is imported here: import the module you need (``from hf_sparsity.storage.masks_file
import load_masks``); the public entry points are also on the package root.
"""
