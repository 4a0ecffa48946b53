"""The old path of :mod:`hf_sparsity.ift.models`: folders written by ``hf_sparsity ift`` before the
move import ``apply_ift_section`` from here in their ``modeling_sparse_ift.py``."""

from .ift.models import (  # noqa: F401
    IFT_SECTION,
    MODULE_TRANSFORMS,
    TRANSFORMS,
    DopedLinear,
    FactorizedLinear,
    ParallelLinear,
    apply_ift_section,
    build_ift_model,
    make_layer,
    modeling_code,
)
