"""hf_sparsity: unstructured weight sparsity for HuggingFace Transformers.

from hf_sparsity import SparsityConfig, SparsityCallback
trainer = Trainer(..., callbacks=[SparsityCallback(SparsityConfig(sparsity=0.75))])
"""

__version__ = "0.1.0"

from .config import (  # noqa: E402
    SparsityConfig,
    SparsityConfigMixin,
    get_sparsity_config,
    set_sparsity_config,
)
from .engine import SparsityEngine  # noqa: E402
from .targeting import format_plan, plan_sparsity  # noqa: E402
from .utils import SparsityError  # noqa: E402


def __getattr__(name):
    # Trainer-facing pieces import transformers' Trainer machinery; load them on first use.
    if name == "SparsityCallback":
        from .callback import SparsityCallback

        return SparsityCallback
    if name in ("finalize_checkpoint", "from_sentinel", "to_sentinel"):
        from . import finalize

        return getattr(finalize, name)
    if name in ("inspect_checkpoint", "load_sparse_model"):
        from . import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'hf_sparsity' has no attribute {name!r}")


__all__ = [
    "SparsityCallback",
    "SparsityConfig",
    "SparsityConfigMixin",
    "SparsityEngine",
    "SparsityError",
    "finalize_checkpoint",
    "format_plan",
    "from_sentinel",
    "get_sparsity_config",
    "inspect_checkpoint",
    "load_sparse_model",
    "plan_sparsity",
    "set_sparsity_config",
    "to_sentinel",
]
