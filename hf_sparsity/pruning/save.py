"""Write a pruned model as a sparse model folder, atomically.

The folder is what training writes: weights with exact zeros at masked positions,
``sparsity_masks.safetensors``, the ``sparsity`` section in ``config.json`` (with the
one-shot method and calibration settings under ``_state.oneshot``) and the tokenizer.
Stock transformers loads it; :class:`~hf_sparsity.SparsityCallback` picks up its masks.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..constants import SPARSITY_MASKS_NAME
from ..mask_engine.config import SparsityConfig, set_sparsity_config
from ..storage.masks_file import save_masks
from ..utils import atomic_dir
from .oneshot import OneShotResult


def oneshot_state(result: OneShotResult, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON-simple record of a one-shot run, kept in config.json and in the mask file."""
    record = {"method": result.method, "seconds": round(result.seconds, 2), **result.info}
    record.update(extra or {})
    return {
        "optimizer_steps": 0,
        "events": [{"step": 0, "kind": "oneshot", "method": result.method}],
        "oneshot": record,
    }


def save_pruned(
    model,
    result: OneShotResult,
    out_dir: str | os.PathLike,
    config: SparsityConfig | None = None,
    tokenizer=None,
    info: dict[str, Any] | None = None,
    model_dir: str | os.PathLike | None = None,
    overwrite: bool = False,
) -> Path:
    """Save ``model`` (already pruned by :func:`prune_oneshot`) with ``result.masks`` to ``out_dir``."""
    with atomic_dir(out_dir, overwrite=overwrite, source=model_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        write_sparsity_files(tmp, model.config, result, config, tokenizer, info)
    return Path(out_dir)


def write_sparsity_files(
    folder: str | os.PathLike,
    model_config,
    result: OneShotResult,
    config: SparsityConfig | None = None,
    tokenizer=None,
    info: dict[str, Any] | None = None,
) -> None:
    """``config.json`` with the sparsity section, the mask file and the tokenizer, into ``folder``
    (weights are written by the caller: ``save_pretrained``, or shard by shard when streaming)."""
    if config is None:
        config = SparsityConfig(sparsity=_overall_level(result))
    state = oneshot_state(result, info)
    set_sparsity_config(model_config, config, state={"oneshot": state["oneshot"]})
    model_config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    save_masks(os.path.join(folder, SPARSITY_MASKS_NAME), result.masks, {"state": state})


def _overall_level(result: OneShotResult) -> float:
    total = sum(m.numel() for m in result.masks.values())
    zeros = sum(int((m == 0).sum()) for m in result.masks.values())
    return round(zeros / max(total, 1), 6)
