"""Load a model folder for evaluation (applying its masks) and describe its sparsity."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..constants import SPARSITY_MASKS_NAME
from ..modeling import apply_masks, sparsity_table
from ..serialization import load_masks_for
from ..utils import SparsityError

__all__ = ["apply_masks", "load_masks_for", "load_model_for_eval", "sparsity_summary", "flops_summary"]

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
_DTYPES.update({"float16": torch.float16, "fp16": torch.float16})


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """``None``/``"auto"`` -> CUDA when available, else CPU."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if str(dtype) not in _DTYPES:
        raise SparsityError(f"Unknown dtype {dtype!r}; use one of {', '.join(sorted(_DTYPES))}.")
    return _DTYPES[str(dtype)]


def load_model_for_eval(
    path: str | os.PathLike,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    tokenizer: Any = None,
) -> tuple[nn.Module, Any, dict[str, torch.Tensor] | None]:
    """Load a causal LM folder for evaluation.

    A sparse folder (``sparsity_masks.safetensors`` next to the weights) gets its masks
    applied (weights multiplied by the mask) before anything is scored; a vanilla or
    finalized folder is used as is. Returns ``(model, tokenizer, masks_or_None)``; the
    model is in eval mode on ``device``. ``tokenizer`` is a folder, a tokenizer object,
    or ``None`` for the model folder's own.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise SparsityError(
            f"{str(path)!r} is not a model folder (no config.json). Pass a folder written by "
            "save_pretrained, "
            "e.g. a checkpoint-N/ folder or the output of `hf_sparsity convert`."
        )
    kwargs = {}
    if dtype is not None:
        kwargs["dtype"] = resolve_dtype(dtype)
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    masks = load_masks_for(model, path)
    if masks is not None:
        apply_masks(model, masks)
        logger.info("applied %d masks from %s", len(masks), path / SPARSITY_MASKS_NAME)
    try:
        is_path = tokenizer is None or isinstance(tokenizer, (str, os.PathLike))
        tok = AutoTokenizer.from_pretrained(tokenizer or path) if is_path else tokenizer
    except Exception as e:  # a folder saved without its tokenizer
        raise SparsityError(
            f"No tokenizer could be loaded from {str(tokenizer or path)!r} ({type(e).__name__}: {e}). "
            "Save the tokenizer into the model folder or pass --tokenizer DIR."
        ) from None
    model.to(resolve_device(device)).eval()
    return model, tok, masks


def sparsity_summary(
    model: nn.Module, masks: dict[str, torch.Tensor] | None = None, seq_len: int | None = None
) -> dict[str, Any]:
    """Per-layer and total sparsity of ``model`` as it will be scored.

    With ``masks`` the layers are the masked tensors; without, the default targets
    (projection and FFN weights, see :func:`hf_sparsity.targeting.plan_sparsity`). Each
    layer's ``sparsity`` is the measured fraction of exact zeros in the weight, so a
    finalized checkpoint reports the same numbers as its masked original. Also counts
    total and nonzero parameters (tied weights once) and, when ``hf_sparsity.flops`` is
    available, inference FLOPs per token at ``seq_len`` (default: the model's context).
    """
    from ..config import SparsityConfig
    from ..targeting import plan_sparsity

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
    their ratio, or ``{}`` when the FLOPs module is not available.
    """
    try:
        from ..flops import count_flops
    except ImportError:
        return {}
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
