"""Old import path of :mod:`hf_sparsity.storage.masks_file`; new code imports from there."""

from .storage.masks_file import (  # noqa: F401
    CHECKSUM_KEY,
    check_mask_names,
    has_masks,
    load_masks,
    load_masks_for,
    mask_checksum,
    mask_levels,
    pack_mask,
    read_mask_metadata,
    save_masks,
    unpack_mask,
    verify_checksum,
)
