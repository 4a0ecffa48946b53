# Deprecated import path: the module moved to hf_sparsity.export.finalize.
"""The old path of :mod:`hf_sparsity.export.finalize`; importing it from here warns."""

import warnings

from ..export.finalize import *  # noqa: F403
from ..export.finalize import (  # noqa: F401
    TRAINING_STATE_FILES,
    finalize_checkpoint,
    from_sentinel,
    levels_section,
    to_sentinel,
)

warnings.warn(
    "hf_sparsity.storage.finalize moved to hf_sparsity.export.finalize; import it from there.",
    DeprecationWarning,
    stacklevel=2,
)
