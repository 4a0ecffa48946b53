"""The pruning methods as objects: each owns the statistic its calibration pass collects and its pruning
step, as SparseGPT's reference code gives each layer ``add_batch`` and ``fasterprune``.

:mod:`~hf_sparsity.pruning.methods` holds the arithmetic (scores, per-row and N:M selection, the
SparseGPT sweep); the block loop (:mod:`~hf_sparsity.pruning.oneshot`) asks the method what to
collect and hands it the weight, the statistic and the number of zeros. A new method is a subclass
registered in :data:`ALGORITHMS`; nothing else compares method names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..utils import SparsityError
from . import methods as M
from .statistics import InputHessian, InputNorms


@dataclass
class BlockContext:
    """What a method may need beyond one weight: SparseGPT's settings, which linears share an input
    (their statistic is one tensor) and the inverses already computed for those groups in this block."""

    blocksize: int = 128
    percdamp: float = 0.01
    groups: dict[str, str] = field(default_factory=dict)
    inverses: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


class PruningMethod:
    """One method: ``statistic`` (``None``: no calibration) and :meth:`prune`."""

    name = ""
    statistic: type[InputNorms] | type[InputHessian] | None = None

    @property
    def calibrated(self) -> bool:
        return self.statistic is not None

    def statistic_for(self, refit: bool):
        """What the calibration pass collects: the refit needs the Hessian, whose diagonal serves Wanda."""
        return InputHessian if refit else self.statistic

    def prune(self, W, stat, k: int, nm, name: str, ctx: BlockContext) -> tuple[torch.Tensor, torch.Tensor]:
        """``(updated weight, pruned positions)`` for a ``[out, in]`` float weight with ``k`` zeros (or
        N:M ``nm``); ``stat`` is what :meth:`statistic_for` collected (``None`` without calibration)."""
        raise NotImplementedError

    def settings(self, blocksize: int, percdamp: float) -> dict:
        """The settings of this method worth recording with its masks."""
        return {}


class Magnitude(PruningMethod):
    name = "magnitude"

    def prune(self, W, stat, k, nm, name, ctx):
        return W, M.magnitude_prune(W, k, nm)


class Wanda(PruningMethod):
    name = "wanda"
    statistic = InputNorms

    def prune(self, W, stat, k, nm, name, ctx):
        norms = torch.diagonal(stat) / 2 if stat.dim() == 2 else stat  # the refit collected the Hessian
        return W, M.wanda_prune(W, norms, k, nm)


class SparseGPT(PruningMethod):
    name = "sparsegpt"
    statistic = InputHessian

    def prune(self, W, stat, k, nm, name, ctx):
        group = ctx.groups.get(name, name)
        if group not in ctx.inverses:  # one inverse per shared Hessian (Q/K/V, gate/up)
            ctx.inverses[group] = M.sparsegpt_inverse(stat, ctx.percdamp, name)
        hinv, bs, damp = ctx.inverses[group], ctx.blocksize, ctx.percdamp
        return M.sparsegpt_prune(W, stat, k, nm, blocksize=bs, percdamp=damp, name=name, hinv=hinv)

    def settings(self, blocksize, percdamp):
        return {"blocksize": blocksize, "percdamp": percdamp}


ALGORITHMS: dict[str, PruningMethod] = {m.name: m for m in (Magnitude(), Wanda(), SparseGPT())}


def get_method(name: str) -> PruningMethod:
    """The method called ``name``; a one-line error naming the known ones otherwise."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise SparsityError(f"Unknown pruning method {name!r}; use one of {', '.join(ALGORITHMS)}.") from None


def needs_calibration(method: str, refit: bool, reconstruct_steps: int, masks) -> bool:
    """Whether a run needs calibration activations: to choose masks (a calibrated method), or to refit or
    reconstruct the kept weights (given masks choose nothing)."""
    chooses = masks is None and get_method(method).calibrated
    return chooses or refit or bool(reconstruct_steps)


__all__ = [
    "ALGORITHMS",
    "BlockContext",
    "Magnitude",
    "PruningMethod",
    "SparseGPT",
    "Wanda",
    "get_method",
    "needs_calibration",
]
