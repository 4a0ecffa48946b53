# Deprecated import path: the module moved to hf_sparsity.export.model_card.
"""The old path of :mod:`hf_sparsity.export.model_card`; importing it from here warns."""

import warnings

from ..export.model_card import *  # noqa: F403
from ..export.model_card import (  # noqa: F401
    LEVEL_TOLERANCE,
    README_NAME,
    SECTION_TITLE,
    TAGS,
    card_body,
    card_figures,
    card_section,
    load_eval_results,
    split_front_matter,
    write_model_card,
)

warnings.warn(
    "hf_sparsity.storage.model_card moved to hf_sparsity.export.model_card; import it from there.",
    DeprecationWarning,
    stacklevel=2,
)
