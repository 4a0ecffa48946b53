"""hf_sparsity: unstructured weight sparsity for HuggingFace Transformers.

from hf_sparsity import SparsityConfig, SparsityCallback
trainer = Trainer(..., callbacks=[SparsityCallback(SparsityConfig(sparsity=0.75))])
"""

# Lazy imports: the Trainer-facing and heavy parts load on first use, so `import hf_sparsity` stays light.

from .ift import models as _ift_models  # noqa: F401  (registers the Sparse-IFT architecture for config-only builds)
from .mask_engine.config import (  # noqa: E402
    SparsityConfig,
    SparsityConfigMixin,
    get_sparsity_config,
    set_sparsity_config,
)
from .mask_engine.engine import SparsityEngine  # noqa: E402
from .mask_engine.targeting import format_plan, plan_sparsity  # noqa: E402
from .utils import (
    SparsityError,  # noqa: E402
    __version__,  # noqa: E402,F401
)


def __getattr__(name):
    # Trainer-facing pieces import transformers' Trainer machinery; load them on first use.
    if name == "SparsityCallback":
        from .callback import SparsityCallback

        return SparsityCallback
    if name in ("finalize_checkpoint", "from_sentinel", "to_sentinel"):
        from .export import finalize

        return getattr(finalize, name)
    if name == "inspect_checkpoint":
        from .storage.folders import inspect_checkpoint

        return inspect_checkpoint
    if name == "load_sparse_model":
        from .loading import load_sparse_model

        return load_sparse_model
    if name in ("last_complete_checkpoint", "resume_checkpoint"):
        from .storage import resume

        return getattr(resume, name)
    if name in ("sparsify_for_inference", "restore_dense"):
        from . import inference

        return getattr(inference, name)
    if name in ("SparseBackend", "get_backend", "register_backend", "available_backends"):
        from . import backends

        return getattr(backends, name)
    if name in ("count_flops", "count_flops_from_config", "FlopAccountant"):
        from . import flops

        return getattr(flops, name)
    if name in ("EvalCallback", "evaluate_model"):
        from . import evaluation

        return evaluation.EvalCallback if name == "EvalCallback" else evaluation.evaluate
    if name == "merge_sparse":
        from .export.merge import merge_sparse

        return merge_sparse
    if name == "prune_oneshot":
        from .pruning import prune_oneshot

        return prune_oneshot
    if name == "sparse_ift":
        from .ift import sparse_ift

        return sparse_ift
    raise AttributeError(f"module 'hf_sparsity' has no attribute {name!r}")


__all__ = [
    "EvalCallback",
    "FlopAccountant",
    "SparseBackend",
    "SparsityCallback",
    "SparsityConfig",
    "SparsityConfigMixin",
    "SparsityEngine",
    "SparsityError",
    "available_backends",
    "count_flops",
    "count_flops_from_config",
    "evaluate_model",
    "finalize_checkpoint",
    "format_plan",
    "from_sentinel",
    "get_backend",
    "get_sparsity_config",
    "inspect_checkpoint",
    "last_complete_checkpoint",
    "load_sparse_model",
    "merge_sparse",
    "plan_sparsity",
    "prune_oneshot",
    "register_backend",
    "restore_dense",
    "resume_checkpoint",
    "set_sparsity_config",
    "sparse_ift",
    "sparsify_for_inference",
    "to_sentinel",
]
