"""Mask construction and mask arithmetic. Pure tensor code: no Trainer, no files.

A mask is a ``uint8`` tensor of the weight's shape, 1 = trainable, 0 = pruned.
``uint8`` costs one byte per parameter and ``W.mul_(mask)`` with it is as fast as
with a float mask on CPU (and ~4x faster than with a bool mask).

Exact counts: a tensor at level ``s`` has exactly ``round(s * numel)`` zeros.
Random masks derive their generator from the base seed and the parameter name,
so every rank and every rerun builds the same mask without communication.
"""

from __future__ import annotations

import hashlib

import torch

MASK_DTYPE = torch.uint8


def num_zeros(level: float, numel: int) -> int:
    """The Cerebras Model Zoo's rule: ``round(level * numel)`` zeros per tensor."""
    return int(round(level * numel))


def param_seed(base_seed: int, name: str, salt: str = "") -> int:
    """A 63-bit seed derived from the base seed and the parameter name (stable across processes and runs)."""
    digest = hashlib.sha256(f"{int(base_seed)}|{name}|{salt}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def generator(base_seed: int, name: str, salt: str = "") -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(param_seed(base_seed, name, salt))
    return g


_generator = generator  # the older private name, still imported by cli/bench.py


def random_mask(shape, level: float, base_seed: int, name: str, salt: str = "") -> torch.Tensor:
    """Exactly ``round(level*numel)`` zeros at positions drawn from a per-name generator."""
    numel = 1
    for s in shape:
        numel *= int(s)
    k = num_zeros(level, numel)
    mask = torch.ones(numel, dtype=MASK_DTYPE)
    if k:
        idx = torch.randperm(numel, generator=generator(base_seed, name, salt))[:k]
        mask[idx] = 0
    return mask.view(*shape)


def lowest_k(score: torch.Tensor, k: int) -> torch.Tensor:
    """Bool tensor marking exactly the ``k`` lowest entries of ``score`` (ties broken by position)."""
    flat = score.reshape(-1)
    out = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
    if k <= 0:
        return out.view(score.shape)
    if k >= flat.numel():
        return torch.ones_like(out).view(score.shape)
    # kthvalue is the cheapest exact threshold (quantile fails above 2**24 elements).
    thr = torch.kthvalue(flat, k).values
    below = flat < thr
    need = k - int(below.sum())
    out |= below
    if need > 0:
        ties = torch.nonzero(flat == thr).reshape(-1)[:need]
        out[ties] = True
    return out.view(score.shape)


def magnitude_score(weight: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """|w| in float32, with already-masked positions scored below every live weight."""
    score = weight.detach().abs().float()
    if mask is not None:  # the engine keeps masks on the CPU; the weight may be on a GPU
        score = score.masked_fill(mask.to(score.device) == 0, -1.0)
    return score


def topk_mask(weight: torch.Tensor, level: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Prune the lowest-magnitude weights to exactly ``round(level*numel)`` zeros.

    Positions already masked in ``mask`` stay masked (they are pruned first), so this is
    also the *prune to a higher level* event.
    """
    k = num_zeros(level, weight.numel())
    if mask is not None:
        already = int((mask == 0).sum())
        if k < already:
            raise ValueError(f"topk to level {level} would need to revive weights ({already} masked > {k}).")
    pruned = lowest_k(magnitude_score(weight, mask), k)
    return (~pruned).to(MASK_DTYPE).cpu()


def nm_mask(score: torch.Tensor, n: int, m: int, dim: int = -1) -> torch.Tensor:
    """Keep the ``n`` highest-scoring of every ``m`` consecutive entries along ``dim`` (e.g. 2:4)."""
    x = score.float().movedim(dim, -1)
    if x.shape[-1] % m:
        raise ValueError(
            f"N:M structure {n}:{m} needs the input dimension ({x.shape[-1]}) to be a multiple of {m}."
        )
    groups = x.reshape(*x.shape[:-1], x.shape[-1] // m, m)
    keep = torch.zeros_like(groups, dtype=MASK_DTYPE)
    idx = torch.topk(groups, n, dim=-1, sorted=False).indices
    keep.scatter_(-1, idx, 1)
    return keep.reshape(x.shape).movedim(-1, dim).contiguous().cpu()


def regrow_mask(
    mask: torch.Tensor, level: float, base_seed: int, name: str, salt: str = "regrow"
) -> torch.Tensor:
    """Lower the level: randomly chosen masked positions become trainable again (seeded per name)."""
    k = num_zeros(level, mask.numel())
    flat = mask.reshape(-1).clone()
    masked = torch.nonzero(flat == 0).reshape(-1)
    grow = masked.numel() - k
    if grow < 0:
        raise ValueError(f"regrow to level {level} would need to prune ({masked.numel()} masked < {k}).")
    if grow:
        perm = torch.randperm(masked.numel(), generator=generator(base_seed, name, salt))[:grow]
        flat[masked[perm]] = 1
    return flat.view(mask.shape)


def change_level(
    mask: torch.Tensor, weight: torch.Tensor, level: float, base_seed: int, name: str, salt: str = ""
) -> torch.Tensor:
    """Prune (by magnitude, previously masked stay masked) or regrow (random) to exactly ``level``."""
    k = num_zeros(level, mask.numel())
    have = int((mask == 0).sum())
    if k > have:
        return topk_mask(weight, level, mask)
    if k < have:
        return regrow_mask(mask, level, base_seed, name, salt=f"regrow{salt}")
    return mask.clone()


def mask_level(mask: torch.Tensor) -> float:
    return 1.0 - float(mask.sum(dtype=torch.int64)) / max(mask.numel(), 1)
