"""How many weights each tensor loses: the config's exact counts, or OWL's non-uniform layer levels.

OWL (Yin et al. 2024, "Outlier Weighed Layerwise sparsity") gives blocks with more activation
outliers a lower level. Its reference code shifts each layer's density by up to ``±lambda``
in proportion to the block's outlier ratio (Wanda scores above ``M`` times their block mean)
and re-centres on the target level; here the re-centring is weighted by each block's
targeted parameter count and the per-tensor counts are rounded by largest remainder, so the
total number of zeros equals the uniform plan's exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..masks import num_zeros
from ..utils import SparsityError


@dataclass
class OWLSettings:
    """OWL's two hyper-parameters, with the paper's defaults for LLaMA."""

    lam: float = 0.08  # the largest shift of a block's level away from the target
    outlier_m: float = 5.0  # a score is an outlier above M times its block's mean score

    def __post_init__(self) -> None:
        if not 0.0 <= self.lam < 0.5:
            raise SparsityError(f"OWL lambda = {self.lam} must be in [0, 0.5); the paper uses 0.08.")
        if self.outlier_m <= 0:
            raise SparsityError(f"OWL M = {self.outlier_m} must be positive; the paper uses 5.")


def uniform_counts(levels: dict[str, float], numels: dict[str, int]) -> dict[str, int]:
    """``round(level · numel)`` zeros per tensor, the rule training uses."""
    return {n: num_zeros(levels[n], numels[n]) for n in levels}


def outlier_ratio(scores: list[torch.Tensor], outlier_m: float) -> float:
    """Fraction of a block's Wanda scores above ``outlier_m`` times their mean."""
    flat = torch.cat([s.reshape(-1).float() for s in scores])
    return float((flat > outlier_m * flat.mean()).float().mean())


def owl_counts(
    levels: dict[str, float],
    numels: dict[str, int],
    block_of: dict[str, int],
    ratios: dict[int, float],
    lam: float,
) -> dict[str, int]:
    """Per-tensor zero counts with OWL's per-block shift; their sum equals the uniform plan's exactly."""
    blocks = sorted(ratios)
    r = torch.tensor([ratios[b] for b in blocks], dtype=torch.float64)
    span = float(r.max() - r.min()) if len(blocks) else 0.0
    shift = (r - r.min()) / span * 2 * lam if span > 0 else torch.zeros_like(r)
    weight = torch.tensor(
        [sum(numels[n] for n in levels if block_of[n] == b) for b in blocks], dtype=torch.float64
    )
    shift = shift - (shift * weight).sum() / weight.sum()
    density_shift = dict(zip(blocks, shift.tolist()))
    total = sum(uniform_counts(levels, numels).values())
    names = sorted(levels)
    raw = {n: min(max(levels[n] - density_shift[block_of[n]], 0.0), 0.999) * numels[n] for n in names}
    counts = {n: int(raw[n]) for n in names}
    missing = total - sum(counts.values())
    # Largest remainder first (ties by name), within each tensor's room; then take back if over.
    order = sorted(names, key=lambda n: (-(raw[n] - counts[n]), n))
    while missing != 0:
        step = 1 if missing > 0 else -1
        moved = False
        for n in order if step > 0 else reversed(order):
            if missing == 0:
                break
            if 0 <= counts[n] + step < numels[n]:
                counts[n] += step
                missing -= step
                moved = True
        if not moved:
            raise SparsityError("OWL cannot place the requested number of zeros; lower lambda.")
    return counts
