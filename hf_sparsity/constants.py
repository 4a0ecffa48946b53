"""File names, format identifiers and other constants shared across the package."""

SPARSITY_MASKS_NAME = "sparsity_masks.safetensors"
"""Bit-packed masks, written next to ``model.safetensors``."""

MASK_FORMAT_NAME = "hf_sparsity.masks"
MASK_FORMAT_VERSION = 1

CONFIG_SECTION = "sparsity"
"""Key of the sparsity section inside ``config.json`` (and inside a Cerebras-style YAML)."""

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
