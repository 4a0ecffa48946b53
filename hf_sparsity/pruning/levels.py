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
from .blocks import block_targets, linear_view, run_all
from .methods import wanda_score
from .statistics import InputNorms, StatsHooks


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


def owl_ratios(model, blocks, prefix, targets, chunks, hidden, settings, dev, stream) -> dict[int, float]:
    """One dense pass over the blocks: each block's share of outlier Wanda scores."""
    ratios = {}
    for i, block in enumerate(blocks):
        stream.load(i)
        home = next(block.parameters()).device
        block.to(dev)
        ds = block_targets(model, prefix, i, targets)
        mods = {d.name: model.get_submodule(d.name.rsplit(".", 1)[0]) for d in ds}
        hooks = StatsHooks(mods, InputNorms)
        hidden = run_all(block, chunks, hidden)
        stats = hooks.result()
        scores = [wanda_score(linear_view(model.get_parameter(d.name), d), stats[d.name]) for d in ds]
        ratios[i] = outlier_ratio(scores, settings.outlier_m) if scores else 0.0
        block.to(home)
        stream.release(i)
    return ratios


def zero_counts(model, blocks, prefix, targets, chunks, owl, dev=None, stream=None) -> dict[str, int]:
    """Zeros per targeted tensor: the config's levels exactly, or (``owl`` given) OWL's block levels
    from one dense calibration pass, each weight outside the blocks at the mean ratio."""
    levels = {d.name: float(d.sparsity) for d in targets}
    numels = {d.name: d.numel for d in targets}
    if owl is None:
        return uniform_counts(levels, numels)
    if any(d.structure for d in targets):
        raise SparsityError("OWL levels apply to unstructured sparsity; drop `structure` or the OWL option.")
    block_of = {}
    for i in range(len(blocks)):
        for d in block_targets(model, prefix, i, targets):
            block_of[d.name] = i
    outside = [d.name for d in targets if d.name not in block_of]
    for j, n in enumerate(outside):  # each weight outside the blocks is its own "block" at the target level
        block_of[n] = len(blocks) + j
    ratios = owl_ratios(model, blocks, prefix, targets, chunks, [c.hidden for c in chunks], owl, dev, stream)
    mean_ratio = sum(ratios.values()) / max(len(ratios), 1)
    ratios.update({block_of[n]: mean_ratio for n in outside})
    return owl_counts(levels, numels, block_of, ratios, owl.lam)
