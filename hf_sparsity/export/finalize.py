"""Checkpoint conversions, file by file over safetensors shards (never the whole model in memory).

* :func:`finalize_checkpoint`: bake masks into exact zeros and drop the sparsity files
  and ``config.json`` section -> a vanilla checkpoint for the Hub.
* :func:`to_sentinel` / :func:`from_sentinel`: Cerebras' in-band format, where a NaN
  marks a masked weight (the Cerebras Model Zoo's weight-sparsity format), to and from our mask file.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import safetensors.torch
import torch

from ..constants import CONFIG_NAME, CONFIG_SECTION, SAFE_WEIGHTS_INDEX_NAME, SPARSITY_MASKS_NAME
from ..mask_engine.config import SparsityConfig
from ..storage.folders import MaskReader, iter_shards, read_config
from ..storage.masks_file import save_masks
from ..utils import SparsityError, atomic_dir
from .model_card import card_section, load_eval_results, write_model_card

# Trainer checkpoint files that belong to a training run, not to a model.
TRAINING_STATE_FILES = (
    "optimizer.pt",
    "scheduler.pt",
    "scaler.pt",
    "trainer_state.json",
    "training_args.bin",
)


def _copy_side_files(src: Path, dst: Path, skip: set[str]) -> None:
    for f in src.iterdir():
        if f.name in skip or f.name in TRAINING_STATE_FILES or f.name.startswith("rng_state"):
            continue
        if (dst / f.name).exists():  # a weight shard already rewritten
            continue
        if f.is_file():
            shutil.copy2(f, dst / f.name)


def _write_config(src: Path, dst: Path, section: dict | None) -> None:
    cfg = read_config(src)
    cfg.pop(CONFIG_SECTION, None)
    if section is not None:
        cfg[CONFIG_SECTION] = section
    with open(dst / CONFIG_NAME, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")


def _rewrite_shards(src: Path, dst: Path, transform) -> set[str]:
    """Rewrite each shard with ``transform(name, tensor) -> tensor``; returns the tensor names seen."""
    seen = set()
    for shard, meta, tensors in iter_shards(src, progress=True):
        out = {}
        for name, t in tensors:
            out[name] = transform(name, t).contiguous()
            seen.add(name)
        # looked up at call time, so a caller (or a test simulating a full disk) can wrap it
        safetensors.torch.save_file(out, str(dst / Path(shard).name), metadata=meta)
        del out
    return seen


def finalize_checkpoint(
    in_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    overwrite: bool = False,
    *,
    model_card: bool = True,
    results: str | os.PathLike | None = None,
) -> str:
    """Masked weights -> exact 0; no mask file; no ``sparsity`` section. Atomic; refuses an existing
    ``out_dir``.

    With ``model_card`` (the default) ``README.md`` gets the Hub card of
    :mod:`hf_sparsity.export.model_card`, with the evaluation table of ``results`` (an
    ``hf_sparsity eval`` results.json) when given.
    """

    eval_results = load_eval_results(results)
    src = Path(in_dir)
    if model_card:
        card_section(src)  # a section the card cannot show is refused before anything is written
    masks = MaskReader(src)
    if masks.path is None and CONFIG_SECTION not in read_config(src):
        raise SparsityError(
            f"{str(src)!r} has no {SPARSITY_MASKS_NAME} and no sparsity section: nothing to finalize."
        )
    with atomic_dir(out_dir, overwrite=overwrite, source=src) as tmp:

        def bake(name, t):
            if name in masks:
                m = masks.get(name)
                if tuple(m.shape) != tuple(t.shape):
                    raise SparsityError(
                        f"Mask {name!r} has shape {list(m.shape)}, the weight {list(t.shape)}."
                    )
                return t * m.to(t.dtype)
            return t

        seen = _rewrite_shards(src, tmp, bake)
        missing = sorted(set(masks.names()) - seen)
        if missing:
            raise SparsityError(
                f"{SPARSITY_MASKS_NAME} names {len(missing)} tensor(s) the weights lack (e.g. "
                f"{missing[0]!r}); "
                "the mask file belongs to another model."
            )
        _copy_side_files(src, tmp, skip={SPARSITY_MASKS_NAME, CONFIG_NAME})
        _write_config(src, tmp, None)
        if model_card:
            write_model_card(src, tmp, eval_results)
    return str(out_dir)


def to_sentinel(in_dir: str | os.PathLike, out_dir: str | os.PathLike, overwrite: bool = False) -> str:
    """Write a Cerebras-style checkpoint: masked weights become NaN; the sparsity section stays in
    config.json."""
    src = Path(in_dir)
    masks = MaskReader(src)
    if masks.path is None:
        raise SparsityError(
            f"{str(src)!r} has no {SPARSITY_MASKS_NAME}: nothing marks which weights are masked."
        )
    section = read_config(src).get(CONFIG_SECTION)
    with atomic_dir(out_dir, overwrite=overwrite, source=src) as tmp:

        def mark(name, t):
            if name in masks:
                if not t.is_floating_point():
                    raise SparsityError(
                        f"{name!r} is not a floating-point tensor; it cannot hold a NaN sentinel."
                    )
                return t.masked_fill(masks.get(name) == 0, float("nan"))
            return t

        _rewrite_shards(src, tmp, mark)
        _copy_side_files(src, tmp, skip={SPARSITY_MASKS_NAME, CONFIG_NAME})
        _write_config(src, tmp, section or levels_section(masks.info))
    return str(out_dir)


def from_sentinel(in_dir: str | os.PathLike, out_dir: str | os.PathLike, overwrite: bool = False) -> str:
    """Import a NaN-sentinel checkpoint: NaN -> 0 and a mask file marking exactly those positions.

    Only NaN marks a masked weight (an exact 0 in the weights stays trainable): masks are
    never inferred from zeros.
    """
    src = Path(in_dir)
    found: dict[str, torch.Tensor] = {}
    with atomic_dir(out_dir, overwrite=overwrite, source=src) as tmp:

        def unmark(name, t):
            if t.is_floating_point():
                nan = torch.isnan(t)
                if bool(nan.any()):
                    found[name] = (~nan).to(torch.uint8)
                    return t.masked_fill(nan, 0.0)
            return t

        _rewrite_shards(src, tmp, unmark)
        if not found:
            raise SparsityError(
                f"{str(src)!r} holds no NaN sentinel: it is not a sparse Cerebras checkpoint."
            )
        save_masks(tmp / SPARSITY_MASKS_NAME, found, {"source": "nan-sentinel"})
        section = read_config(src).get(CONFIG_SECTION)
        _copy_side_files(src, tmp, skip={SPARSITY_MASKS_NAME, CONFIG_NAME})
        levels = {n: 1 - float(m.sum()) / m.numel() for n, m in found.items()}
        _write_config(src, tmp, section or levels_section({n: {"level": v} for n, v in levels.items()}))
    return str(out_dir)


def levels_section(info: dict) -> dict:
    """A config section reproducing per-tensor levels exactly (one anchored pattern per tensor)."""
    pats = {f"^{re.escape(n)}$": {"sparsity": _floor_level(v["level"])} for n, v in info.items()}
    return SparsityConfig(param_name_patterns=pats, init_method="topk").to_dict()


def _floor_level(level: float) -> float:
    # Keep the level < 1 and stable through JSON; round() of it * numel gives back the count.
    return min(float(level), math.nextafter(1.0, 0.0))


__all__ = ["finalize_checkpoint", "from_sentinel", "to_sentinel", "SAFE_WEIGHTS_INDEX_NAME"]
