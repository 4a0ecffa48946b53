"""Load a model folder for evaluation (applying its masks) and describe its sparsity."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn

from ..flops import count_flops
from ..loading import load_model_folder, load_tokenizer, resolve_device
from ..mask_engine.config import SparsityConfig
from ..mask_engine.targeting import plan_sparsity
from ..modeling import apply_masks, sparsity_table
from ..storage.masks_file import load_masks_for

__all__ = ["apply_masks", "load_masks_for", "load_model_for_eval", "sparsity_summary", "flops_summary"]

logger = logging.getLogger(__name__)


def load_model_for_eval(
    path: str | os.PathLike,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    tokenizer: Any = None,
) -> tuple[nn.Module, Any, dict[str, torch.Tensor] | None]:
    """A causal LM folder for evaluation: :func:`hf_sparsity.loading.load_model_folder` and its tokenizer.

    A sparse folder (``sparsity_masks.safetensors`` next to the weights) gets its masks
    applied (weights multiplied by the mask) before anything is scored; a vanilla or
    finalized folder is used as is. Returns ``(model, tokenizer, masks_or_None)``; the
    model is in eval mode on ``device`` (default: CUDA when available). ``tokenizer`` is a
    folder, a tokenizer object, or ``None`` for the model folder's own.
    """
    model, masks = load_model_folder(path, dtype=dtype)
    tok = load_tokenizer(tokenizer, path)
    model.to(resolve_device(device))
    return model, tok, masks


def sparsity_summary(
    model: nn.Module, masks: dict[str, torch.Tensor] | None = None, seq_len: int | None = None
) -> dict[str, Any]:
    """Per-layer and total sparsity of ``model`` as it will be scored.

    With ``masks`` the layers are the masked tensors; without, the default targets
    (projection and FFN weights, see :func:`hf_sparsity.mask_engine.targeting.plan_sparsity`). Each
    layer's ``sparsity`` is the measured fraction of exact zeros in the weight, so a
    finalized checkpoint reports the same numbers as its masked original. Also counts
    total and nonzero parameters (tied weights once) and, when ``hf_sparsity.flops`` is
    available, inference FLOPs per token at ``seq_len`` (default: the model's context).
    """

    params = dict(model.named_parameters())
    if masks:
        names = list(masks)
        source = "masks"
    else:
        plan = plan_sparsity(model, SparsityConfig(sparsity=0.5), strict=False)
        names = [d.name for d in plan if d.sparsify]
        source = "default targets (weights measured)"
    layers = sparsity_table(model, names, masks, mask_sparsity=True)
    tz = sum(r["zeros"] for r in layers)
    tn = sum(r["numel"] for r in layers)
    total_params = sum(p.numel() for p in params.values())
    out: dict[str, Any] = {
        "source": source,
        "targeted_params": tn,
        "targeted_zeros": tz,
        "sparsity": tz / max(tn, 1),
        "total_params": total_params,
        "nonzero_params": total_params - tz,
        "layers": layers,
    }
    out.update(flops_summary(model, {r["name"]: r["sparsity"] for r in layers}, masks, seq_len))
    return out


def flops_summary(
    model: nn.Module,
    levels: dict[str, float],
    masks: dict[str, torch.Tensor] | None = None,
    seq_len: int | None = None,
) -> dict[str, Any]:
    """Inference FLOPs per token from :mod:`hf_sparsity.flops` (Chinchilla App. F, embeddings excluded).

    Returns ``{"flops": {...}}`` with the sparse and dense inference FLOPs per token and
    their ratio, or ``{}`` when the model cannot be counted.
    """
    try:
        if masks:
            report = count_flops(model, masks=masks, seq_len=seq_len)
        else:
            report = count_flops(model, levels={k: v for k, v in levels.items() if v > 0}, seq_len=seq_len)
    except Exception as e:  # never fail an evaluation over its FLOPs stamp
        logger.warning("FLOP count failed (%s: %s); results carry no FLOPs.", type(e).__name__, e)
        return {"flops": {"error": f"{type(e).__name__}: {e}"}}
    summary = report.summary()
    dense = report.dense().inference_flops_per_token
    summary["dense_inference_flops_per_token"] = dense
    summary["inference_flop_reduction"] = dense / max(report.inference_flops_per_token, 1e-30)
    return {"flops": summary}
