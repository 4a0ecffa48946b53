# Deprecated import path: the module moved to hf_sparsity.inference.decoding.
"""The old path of :mod:`hf_sparsity.inference.decoding`; importing it from here warns. The name is bound
to the moved module itself (not a copy), so what is set on it reaches the code that reads it."""

import sys
import warnings

from .inference import decoding as _moved

warnings.warn(
    "hf_sparsity.decoding moved to hf_sparsity.inference.decoding; import it from there.",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
