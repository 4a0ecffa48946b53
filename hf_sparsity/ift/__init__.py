"""Sparse-IFT: configs whose layers are iso-FLOP at a sparsity, the models they build, the report.

* :mod:`~hf_sparsity.ift.transform`: :func:`sparse_ift`, the config transformation (wide,
  parallel, factorized, doped).
* :mod:`~hf_sparsity.ift.models`: the layers of the module transforms and
  :func:`build_ift_model`.
* :mod:`~hf_sparsity.ift.result`: :class:`IFTResult`, per-layer and whole-model FLOPs, saving.

``models`` is a leaf (:mod:`hf_sparsity.flops` builds Sparse-IFT architectures with it);
``transform`` and ``result`` count FLOPs, so they are loaded on first use.
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


def __getattr__(name: str):
    # result and transform sit above hf_sparsity.flops, which imports .models (FLOPs of a Sparse-IFT
    # config): loaded on first use, so importing the layers never imports flops.
    if name in ("IFTLayer", "IFTResult"):
        from . import result

        return getattr(result, name)
    if name in ("read_ift_config", "sparse_ift", "wide_width"):
        from . import transform

        return getattr(transform, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
