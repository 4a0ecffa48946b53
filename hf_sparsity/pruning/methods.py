"""One-shot pruning of one weight matrix: magnitude, Wanda and SparseGPT. Pure tensor code.

Every function takes the weight in the *linear view* ``W`` of shape ``(out, in)``
(GPT-2's Conv1D weights are transposed by the caller) and an exact number ``k`` of
zeros (or an ``(n, m)`` structure), and returns a bool tensor ``pruned`` of ``W``'s
shape; SparseGPT also returns the updated weights. Ties are broken by position
(stable sorts), so a given weight and calibration set always give the same mask.

The algorithms follow the reference code: ``locuslab/wanda`` (``lib/prune.py``) and
``IST-DASLab/sparsegpt`` (``sparsegpt.py``, ``fasterprune``).
"""

from __future__ import annotations

import logging

import torch

from ..masks import lowest_k
from ..utils import SparsityError, torch_threads

logger = logging.getLogger(__name__)

METHODS = ("magnitude", "wanda", "sparsegpt")


def row_counts(k: int, rows: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Spread ``k`` zeros over ``rows`` rows as evenly as possible (the first rows take the remainder)."""
    counts = torch.full((rows,), k // rows, dtype=torch.long, device=device)
    counts[: k % rows] += 1
    return counts


def prune_per_row(score: torch.Tensor, k: int) -> torch.Tensor:
    """Exactly ``k`` pruned entries, the lowest-scoring of each row, ``k`` spread evenly over rows.

    Wanda compares scores within an output row; with ``k`` a multiple of the row count this is
    the reference's ``sort(W_metric, dim=-1, stable=True)[1][:, :int(cols * s)]``.
    """
    rows, cols = score.shape
    order = torch.sort(score, dim=1, stable=True).indices
    counts = row_counts(k, rows, score.device)  # on the score's device: the GPU prunes without a copy
    take = torch.arange(cols, device=score.device).unsqueeze(0) < counts.unsqueeze(1)
    pruned = torch.zeros_like(score, dtype=torch.bool)
    pruned.scatter_(1, order, take)
    return pruned


def prune_nm(score: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Prune the ``m - n`` lowest-scoring of every ``m`` consecutive entries along the input dimension."""
    rows, cols = score.shape
    if cols % m:
        raise SparsityError(
            f"N:M structure {n}:{m} needs the input dimension ({cols}) to be a multiple of {m}; "
            "exclude this weight with `param_name_patterns`, or use unstructured sparsity."
        )
    # Ties go to the later position, as torch.topk(largest=False) in the reference code picks them
    # on CPU (dequantized checkpoints have many equal magnitudes within a group).
    groups = score.reshape(rows, cols // m, m).flip(-1)
    order = torch.sort(groups, dim=-1, stable=True).indices[..., : m - n]
    pruned = torch.zeros_like(groups, dtype=torch.bool)
    pruned.scatter_(-1, order, True)
    return pruned.flip(-1).reshape(rows, cols)


def magnitude_prune(W: torch.Tensor, k: int, nm: tuple[int, int] | None = None) -> torch.Tensor:
    """Lowest ``|W|``: one threshold over the whole tensor, or per group of ``m`` for N:M."""
    score = W.detach().abs().float()
    if nm is not None:
        return prune_nm(score, *nm)
    return lowest_k(score, k)


def wanda_score(W: torch.Tensor, sq_norm: torch.Tensor) -> torch.Tensor:
    """``|W_ij| * ||X_j||_2``: the weight times the L2 norm of its input feature over the calibration
    tokens."""
    return W.detach().abs().float() * sq_norm.float().sqrt().reshape(1, -1)


def wanda_prune(
    W: torch.Tensor, sq_norm: torch.Tensor, k: int, nm: tuple[int, int] | None = None
) -> torch.Tensor:
    """Wanda: prune the lowest ``|W|·||X||`` within each output row (or within each group of ``m``)."""
    score = wanda_score(W, sq_norm)
    if nm is not None:
        return prune_nm(score, *nm)
    return prune_per_row(score, k)


def damped_inverse_cholesky(
    H: torch.Tensor, percdamp: float = 0.01, name: str = "weight", max_tries: int = 6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Upper Cholesky factor of ``(H + λI)^-1`` with ``λ = percdamp · mean(diag H)``, and the dead inputs.

    Inputs that never fire (zero diagonal) get a unit diagonal, as in the reference. If ``H`` is
    still not positive definite, the damping is multiplied by 10 and retried (with a warning).
    """
    H = H.clone().float()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    diag = torch.arange(H.shape[0], device=H.device)
    mean_diag = torch.mean(torch.diag(H))
    damp_frac = percdamp
    for attempt in range(max_tries):
        Hd = H.clone()
        Hd[diag, diag] += damp_frac * mean_diag
        L, info = torch.linalg.cholesky_ex(Hd)
        if int(info) == 0:
            Hinv = torch.cholesky_inverse(L)
            U, info = torch.linalg.cholesky_ex(Hinv, upper=True)
            if int(info) == 0:
                if attempt:
                    logger.warning("%s: Hessian needed damping %.3g of its mean diagonal.", name, damp_frac)
                return U, dead
        logger.warning(
            "%s: Hessian is not positive definite with damping %.3g; retrying with %.3g.",
            name,
            damp_frac,
            damp_frac * 10,
        )
        damp_frac *= 10
    raise SparsityError(
        f"SparseGPT: the Hessian of {name} is not positive definite even with damping {damp_frac / 10:.3g} "
        "of its mean diagonal. Use more calibration samples (--nsamples), a larger --percdamp, or "
        "--method wanda for this model."
    )


def block_zero_counts(k: int, rows: int, cols: int, blocksize: int) -> list[int]:
    """Zeros per column block so that the blocks sum to exactly ``k`` (cumulative rounding)."""
    out, prev = [], 0
    total = rows * cols
    for i2 in [min(i + blocksize, cols) for i in range(0, cols, blocksize)]:
        upto = int(round(k * rows * i2 / total)) if total else 0
        out.append(upto - prev)
        prev = upto
    return out


def sparsegpt_inverse(H: torch.Tensor, percdamp: float = 0.01, name: str = "weight"):
    """:func:`damped_inverse_cholesky` as :func:`sparsegpt_prune` computes it (one thread, so the
    same floats): for callers that share one inverse between linears reading the same input."""
    with torch_threads(1):  # the same floats as sparsegpt_prune (one thread)
        return damped_inverse_cholesky(H, percdamp, name)


@torch.no_grad()
def sparsegpt_prune(
    W: torch.Tensor,
    H: torch.Tensor,
    k: int,
    nm: tuple[int, int] | None = None,
    blocksize: int = 128,
    percdamp: float = 0.01,
    name: str = "weight",
    hinv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseGPT (``fasterprune``): choose the mask block by block and update the kept weights (OBS).

    ``H`` is the layer's input Hessian ``2/N · Σ XᵀX``. Returns ``(W_new, pruned)``; ``W_new`` has
    exact zeros where ``pruned``. The mask of each column block of ``blocksize`` is the lowest
    ``w² / [H⁻¹]_jj²`` of the *updated* weights, with the tensor's ``k`` zeros spread over the
    blocks by cumulative rounding (the reference takes ``int(s·block)`` per block); for N:M each
    group of ``m`` columns is chosen when the sweep reaches it. ``hinv``: the result of
    :func:`damped_inverse_cholesky` for ``H`` when the caller already has it (linears that read the
    same input share one Hessian, so one inverse).
    """
    with torch_threads(1):  # thousands of tiny ops: threads only synchronize (0.6 s vs 10 s at 576x576)
        return _sparsegpt(W, H, k, nm, blocksize, percdamp, name, hinv)


def _sparsegpt(W, H, k, nm, blocksize, percdamp, name, hinv=None):
    W = W.detach().clone().float()
    rows, cols = W.shape
    if nm is not None and blocksize % nm[1]:
        blocksize = max(nm[1], blocksize // nm[1] * nm[1])
    Hinv, dead = hinv if hinv is not None else damped_inverse_cholesky(H, percdamp, name)
    W[:, dead] = 0
    pruned = torch.zeros_like(W, dtype=torch.bool)
    counts = block_zero_counts(k, rows, cols, blocksize)
    for b, i1 in enumerate(range(0, cols, blocksize)):
        i2 = min(i1 + blocksize, cols)
        W1 = W[:, i1:i2].clone()
        Q1 = torch.zeros_like(W1)
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        d1 = torch.diag(Hinv1)
        if nm is None:
            mask1 = lowest_k(W1**2 / d1.reshape(1, -1) ** 2, counts[b])
        else:
            mask1 = torch.zeros_like(W1, dtype=torch.bool)
        for i in range(i2 - i1):
            if nm is not None and i % nm[1] == 0:
                m = nm[1]
                score = W1[:, i : i + m] ** 2 / d1[i : i + m].reshape(1, -1) ** 2
                mask1[:, i : i + m] = prune_nm(score, nm[0], m)
            w = W1[:, i]
            q = w.clone()
            q[mask1[:, i]] = 0
            Q1[:, i] = q
            err = (w - q) / d1[i]
            W1[:, i:] -= err.unsqueeze(1).matmul(Hinv1[i, i:].unsqueeze(0))
            Err1[:, i] = err
        W[:, i1:i2] = Q1
        pruned[:, i1:i2] = mask1
        W[:, i2:] -= Err1.matmul(Hinv[i1:i2, i2:])
    W[pruned] = 0
    return W, pruned
