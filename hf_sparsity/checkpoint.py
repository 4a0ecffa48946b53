"""Old import path of :mod:`hf_sparsity.storage.folders` and :mod:`hf_sparsity.storage.resume`; new
code imports from there."""

from .storage.folders import (  # noqa: F401
    MaskReader,
    check_masks_match_weights,
    check_weights_readable,
    format_inspection,
    inspect_checkpoint,
    iter_shards,
    iter_tensors,
    read_config,
    safetensors_error,
    unreadable_error,
    weight_shards,
)
from .storage.resume import checkpoint_problem, last_complete_checkpoint, resume_checkpoint  # noqa: F401

# The names these had before they were public.
_safetensors_error = safetensors_error
_unreadable = unreadable_error
