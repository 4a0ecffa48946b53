"""What one calibration pass collects for a block's linears: each statistic says how a batch of layer
inputs adds to it and how the sum is scaled, and :class:`StatsHooks` collects it with forward hooks.

* :class:`InputNorms` (Wanda, OWL's outlier ratios): ``Σ‖x_j‖² / N`` per input feature ``j``.
* :class:`InputHessian` (SparseGPT, the refit): ``2 / N · XᵀX``; its diagonal / 2 is Wanda's statistic.

The scales end where the reference code's running averages end (Sun et al. 2023, arXiv:2306.11695;
Frantar & Alistarh 2023, arXiv:2301.00774).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn


class InputNorms:
    """Wanda's statistic: the squared L2 norm of each input feature over the calibration tokens."""

    scale = 1.0

    @staticmethod
    def add(x: torch.Tensor) -> torch.Tensor:
        return (x * x).sum(0)


class InputHessian:
    """SparseGPT's statistic: the layer-input Hessian ``2/N · XᵀX`` (float32, ``in x in``)."""

    scale = 2.0

    @staticmethod
    def add(x: torch.Tensor) -> torch.Tensor:
        return x.t() @ x


class StatsHooks:
    """Forward hooks accumulating ``statistic`` over the inputs of a block's linears.

    Linears fed the very same tensor (Q/K/V, gate/up) share one accumulator: the reference
    computes the same ``XᵀX`` once per linear, which costs as much as the block's forward.
    """

    def __init__(self, modules: dict[str, nn.Module], statistic: type[InputNorms] | type[InputHessian]):
        self.statistic, self.stats, self.nseq, self.group = statistic, {}, defaultdict(int), {}
        self._last: tuple[torch.Tensor, str] | None = None  # held, so its storage cannot be reused
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in modules.items()]

    def _hook(self, name: str):
        def hook(module, inputs, output):
            x = inputs[0]
            if self._last is not None and self._last[0] is x:
                self.group.setdefault(name, self._last[1])
                return
            group = self.group.setdefault(name, name)
            self._last = (x, group)
            self.nseq[group] += x.shape[0] if x.dim() == 3 else 1
            add = self.statistic.add(x.detach().reshape(-1, x.shape[-1]).float())
            if group in self.stats:
                self.stats[group].add_(add)
            else:
                self.stats[group] = add

        return hook

    def result(self) -> dict[str, torch.Tensor]:
        """Remove the hooks; the statistic of each linear (shared tensors for linears in one group)."""
        for h in self.handles:
            h.remove()
        self._last = None
        for g, s in self.stats.items():  # in place: one copy of each Hessian at a time
            s.mul_(self.statistic.scale / max(self.nseq[g], 1))
        return {n: self.stats[g] for n, g in self.group.items()}


__all__ = ["InputHessian", "InputNorms", "StatsHooks"]
