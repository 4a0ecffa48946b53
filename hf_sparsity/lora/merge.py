# Deprecated import path: the module moved to hf_sparsity.export.merge.
"""The old path of :mod:`hf_sparsity.export.merge`; importing it from here warns."""

import warnings

from ..export.merge import *  # noqa: F403
from ..export.merge import merge_sparse  # noqa: F401

warnings.warn(
    "hf_sparsity.lora.merge moved to hf_sparsity.export.merge; import it from there.",
    DeprecationWarning,
    stacklevel=2,
)
