"""Layers of the Sparse-IFT family and the code that puts them into a Hugging Face model.

Each layer replaces one dense ``d_in -> d_out`` projection (an ``nn.Linear`` or a
GPT-2 ``Conv1D``) and is trained sparse so its FLOPs match the dense original
(Thangarasa et al. 2023, "Sparse-IFT", arXiv:2303.11525):

* :class:`ParallelLinear` (Sparse-Parallel): ``k`` sparse branches of the same
  shape, outputs summed;
* :class:`FactorizedLinear` (Sparse-Factorized): ``W -> V(U x)``, both factors sparse;
* :class:`DopedLinear` (Sparse-Doped): a sparse ``W`` plus a dense low-rank ``B A``.

The sparse weights are ``nn.Linear`` children, so the default targeting rule picks
them; the dense low-rank factors of :class:`DopedLinear` are plain parameters of
the layer itself, which the default rule leaves dense. Sparse-Wide needs no layer
of its own: it is a wider config (see :mod:`hf_sparsity.ift.transform`).

A transformed model is described by the ``sparse_ift`` section of its config::

    {"transform": "factorized", "sparsity": 0.5,
     "modules": {"transformer.h.0.attn.c_attn": {"rank": 1152}, ...}}

and rebuilt from it with :func:`build_ift_model` (or ``AutoModelForCausalLM`` with
``trust_remote_code=True`` from a folder written by ``hf_sparsity ift``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..modeling import linear_dims as _dims
from ..modeling import register_architecture
from ..utils import SparsityError

TRANSFORMS = ("wide", "parallel", "factorized", "doped")
MODULE_TRANSFORMS = ("parallel", "factorized", "doped")
IFT_SECTION = "sparse_ift"


def _normal_(w: torch.Tensor, std: float) -> None:
    if w.device.type != "meta":
        nn.init.normal_(w, mean=0.0, std=std)


def _zeros_(t: torch.Tensor | None) -> None:
    if t is not None and t.device.type != "meta":
        nn.init.zeros_(t)


class ParallelLinear(nn.Module):
    """Sparse-Parallel: ``y = sum_i W_i x + b`` over ``k`` same-shape branches (bias on branch 0 only)."""

    def __init__(self, in_features: int, out_features: int, k: int, bias: bool = True, std: float = 0.02):
        super().__init__()
        if k < 1:
            raise SparsityError(f"ParallelLinear needs k >= 1 branches, got {k}.")
        self.in_features, self.out_features, self.k = in_features, out_features, k
        self.branches = nn.ModuleList(
            nn.Linear(in_features, out_features, bias=bias and i == 0) for i in range(k)
        )
        for b in self.branches:
            _normal_(b.weight, std / math.sqrt(k))  # the sum keeps the original output variance
            _zeros_(b.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.branches[0](x)
        for b in self.branches[1:]:
            y = y + b(x)
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, k={self.k}"


class FactorizedLinear(nn.Module):
    """Sparse-Factorized: ``y = V (U x) + b`` with ``U: d_in -> rank`` and ``V: rank -> d_out``, both
    sparse."""

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = True, std: float = 0.02):
        super().__init__()
        if rank < 1:
            raise SparsityError(f"FactorizedLinear needs rank >= 1, got {rank}.")
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.u = nn.Linear(in_features, rank, bias=False)
        self.v = nn.Linear(rank, out_features, bias=bias)
        # Var(VU) = rank * std_u^2 * std_v^2 = std^2 keeps the dense layer's initial scale.
        f = math.sqrt(std / math.sqrt(rank))
        _normal_(self.u.weight, f)
        _normal_(self.v.weight, f)
        _zeros_(self.v.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.v(self.u(x))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}"


class DopedLinear(nn.Module):
    """Sparse-Doped: ``y = W_s x + B (A x) + b``: ``W_s`` sparse, ``B A`` a dense rank-``rank`` term.

    ``low_rank_a`` (rank x d_in) and ``low_rank_b`` (d_out x rank) are parameters of this
    module, not ``nn.Linear`` children, so the default targeting rule keeps them dense;
    :meth:`hf_sparsity_matmuls` declares them to the FLOP counter. ``B`` starts at 0
    (as LoRA does), so at initialisation the layer is its sparse part.
    """

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = True, std: float = 0.02):
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.sparse = nn.Linear(in_features, out_features, bias=bias)
        _normal_(self.sparse.weight, std)
        _zeros_(self.sparse.bias)
        self.low_rank_a = nn.Parameter(torch.empty(rank, in_features))
        self.low_rank_b = nn.Parameter(torch.empty(out_features, rank))
        _normal_(self.low_rank_a, std)
        _zeros_(self.low_rank_b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.sparse(x)
        if self.rank:
            y = y + F.linear(F.linear(x, self.low_rank_a), self.low_rank_b)
        return y

    def hf_sparsity_matmuls(self) -> list[tuple[str, int, int]]:
        """(parameter, d_in, d_out) of the matmuls done with this module's own parameters."""
        if not self.rank:
            return []
        return [("low_rank_a", self.in_features, self.rank), ("low_rank_b", self.rank, self.out_features)]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}"


# ---------------------------------------------------------------------- putting them in a model
def linear_dims(module: nn.Module) -> tuple[int, int, bool]:
    """(d_in, d_out, has_bias) of an ``nn.Linear`` or GPT-2 ``Conv1D``."""
    dims = _dims(module)
    if dims is not None:
        return dims[0], dims[1], module.bias is not None
    raise SparsityError(f"Sparse-IFT can only transform linear layers, not {type(module).__name__}.")


def make_layer(
    transform: str, d_in: int, d_out: int, bias: bool, spec: dict[str, Any], std: float
) -> nn.Module:
    """The replacement layer for one dense projection, from its ``sparse_ift`` module spec."""
    if transform == "parallel":
        return ParallelLinear(d_in, d_out, int(spec["k"]), bias=bias, std=std)
    if transform == "factorized":
        return FactorizedLinear(d_in, d_out, int(spec["rank"]), bias=bias, std=std)
    if transform == "doped":
        return DopedLinear(d_in, d_out, int(spec["rank"]), bias=bias, std=std)
    raise SparsityError(
        f"Unknown Sparse-IFT module transform {transform!r}; use one of {', '.join(MODULE_TRANSFORMS)}."
    )


def apply_ift_section(model: nn.Module, section: dict[str, Any]) -> nn.Module:
    """Replace, in place, every module the ``sparse_ift`` section names by its transformed layer."""
    transform = section.get("transform")
    if transform == "wide":
        return model  # a wider config, built by the stock model class
    if transform not in MODULE_TRANSFORMS:
        raise SparsityError(f"`sparse_ift.transform` = {transform!r}; use one of {', '.join(TRANSFORMS)}.")
    std = float(getattr(getattr(model, "config", None), "initializer_range", 0.02) or 0.02)
    for name, spec in section.get("modules", {}).items():
        try:
            old = model.get_submodule(name)
        except AttributeError:
            raise SparsityError(
                f"`sparse_ift.modules` names {name!r}, which {type(model).__name__} does not have; the "
                "config "
                "does not match this architecture."
            ) from None
        d_in, d_out, bias = linear_dims(old)
        new = make_layer(transform, d_in, d_out, bias, spec, std)
        ref = next(old.parameters())
        new.to(device=ref.device, dtype=ref.dtype)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    return model


def build_ift_model(config: Any) -> nn.Module:
    """Build the causal LM a Sparse-IFT config describes: the stock class, then its layers transformed.

    Honors an enclosing ``torch.device("meta")`` context (nothing allocated).
    """
    from transformers import AutoModelForCausalLM

    section = getattr(config, IFT_SECTION, None)
    model = AutoModelForCausalLM.from_config(config)
    if section:
        apply_ift_section(model, section)
    return model


register_architecture(IFT_SECTION, build_ift_model)


MODELING_TEMPLATE = '''"""Sparse-IFT ({transform}) {base}: written by `hf_sparsity ift`;
needs `hf_sparsity` installed.

Load with ``AutoModelForCausalLM.from_config(config, trust_remote_code=True)`` or
``from_pretrained(folder, trust_remote_code=True)``; or without remote code,
``hf_sparsity.ift.build_ift_model(config)``.
"""

from transformers import {base}

from hf_sparsity.ift import apply_ift_section


class {cls}({base}):
    def __init__(self, config):
        super().__init__(config)
        apply_ift_section(self, config.sparse_ift)
'''


def modeling_code(base_class: str, transform: str) -> tuple[str, str]:
    """(class name, source of ``modeling_sparse_ift.py``) for a transformed ``base_class``."""
    cls = f"SparseIFT{base_class}"
    return cls, MODELING_TEMPLATE.format(base=base_class, cls=cls, transform=transform)
