"""Sparse-IFT: configs whose layers are iso-FLOP at a sparsity, the models they build, the report.

* :mod:`~hf_sparsity.ift.transform`: :func:`sparse_ift`, the config transformation (wide,
  parallel, factorized, doped).
* :mod:`~hf_sparsity.ift.models`: the layers of the module transforms and
  :func:`build_ift_model`.
* :mod:`~hf_sparsity.ift.result`: :class:`IFTResult`, per-layer and whole-model FLOPs, saving.

The whole package sits above :mod:`hf_sparsity.flops`, which never imports it: ``models``
registers the ``sparse_ift`` architecture with :func:`hf_sparsity.modeling.register_architecture`
(the package root imports this package, so the registration is always in place), and the FLOP
counter's config-only path builds whatever a config's registered section describes.
"""

from .models import (
    IFT_SECTION,
    MODULE_TRANSFORMS,
    TRANSFORMS,
    DopedLinear,
    FactorizedLinear,
    ParallelLinear,
    apply_ift_section,
    build_ift_model,
)
from .result import IFTLayer, IFTResult
from .transform import read_ift_config, sparse_ift, wide_width

__all__ = [
    "IFT_SECTION",
    "MODULE_TRANSFORMS",
    "TRANSFORMS",
    "DopedLinear",
    "FactorizedLinear",
    "IFTLayer",
    "IFTResult",
    "ParallelLinear",
    "apply_ift_section",
    "build_ift_model",
    "read_ift_config",
    "sparse_ift",
    "wide_width",
]
