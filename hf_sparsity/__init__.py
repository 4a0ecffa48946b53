"""hf_sparsity: unstructured weight sparsity for HuggingFace Transformers."""

__version__ = "0.1.0"

from .config import SparsityConfig, SparsityConfigMixin, get_sparsity_config, set_sparsity_config  # noqa: E402
from .utils import SparsityError  # noqa: E402

__all__ = [
    "SparsityConfig",
    "SparsityConfigMixin",
    "SparsityError",
    "get_sparsity_config",
    "set_sparsity_config",
]
