"""Reading sparse model folders shard by shard: the weight files, the masks beside them, a per-layer
inspection, and the check that a mask file belongs to the weights it was saved with."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..constants import (
    CONFIG_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    SPARSITY_MASKS_NAME,
)
from ..utils import SparsityError
from .masks_file import read_mask_metadata, unpack_mask, verify_checksum

logger = logging.getLogger(__name__)


def weight_shards(model_dir: str | os.PathLike) -> list[str]:
    """The safetensors weight files of a model folder (one file, or the shards an index lists)."""
    d = Path(model_dir)
    if not d.is_dir():
        raise SparsityError(f"{str(d)!r} is not a folder. Give a model folder holding {SAFE_WEIGHTS_NAME}.")
    index = d / SAFE_WEIGHTS_INDEX_NAME
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [str(d / f) for f in files]
    if (d / SAFE_WEIGHTS_NAME).is_file():
        return [str(d / SAFE_WEIGHTS_NAME)]
    if any(d.glob("*.bin")):
        raise SparsityError(
            f"{str(d)!r} holds PyTorch .bin weights; convert it to safetensors first "
            "(load it and call save_pretrained(dir, safe_serialization=True))."
        )
    raise SparsityError(f"No {SAFE_WEIGHTS_NAME} (or sharded index) in {str(d)!r}.")


def safetensors_error(path: str | os.PathLike) -> str | None:
    """Why a safetensors file cannot be opened (``None``: its header and size are consistent)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except Exception as e:  # safetensors' own error types: a missing, truncated or corrupt file
        return str(e) or type(e).__name__
    return None


def unreadable_error(shard: str, reason: object) -> SparsityError:
    return SparsityError(f"Cannot read {shard!r} ({reason}); the file is truncated or corrupt.")


def check_weights_readable(model_dir: str | os.PathLike) -> None:
    """Open every safetensors weight file of a folder (headers only): a truncated or corrupt one raises
    the error :func:`iter_shards` gives, before a loader fails on it with a traceback."""
    for shard in weight_shards(model_dir):
        reason = safetensors_error(shard)
        if reason:
            raise unreadable_error(shard, reason)


class MaskReader:
    """Lazily unpacks one mask at a time from a ``sparsity_masks.safetensors`` (or returns None)."""

    def __init__(self, model_dir: str | os.PathLike):
        path = os.path.join(str(model_dir), SPARSITY_MASKS_NAME)
        self.path = path if os.path.isfile(path) else None
        meta = read_mask_metadata(path) if self.path else {"tensors": {}}
        self.info: dict[str, Any] = meta["tensors"]
        if self.path:  # packed masks are small (1 bit per weight): verify them all up front
            from safetensors import safe_open

            with safe_open(self.path, framework="pt") as f:
                verify_checksum(self.path, meta, f.get_tensor)

    def __contains__(self, name: str) -> bool:
        return name in self.info

    def names(self) -> list[str]:
        return list(self.info)

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self.path, framework="pt") as f:
            return unpack_mask(f.get_tensor(name), self.info[name]["shape"])


def iter_shards(
    model_dir: str | os.PathLike, progress: bool = False
) -> Iterator[tuple[str, dict[str, str], Iterator[tuple[str, torch.Tensor]]]]:
    """Yield ``(shard_path, shard_metadata, tensors)`` per weight shard; ``tensors`` yields
    ``(name, tensor)`` one at a time. A truncated or corrupt shard raises a clear error.
    The one place that walks a folder's shards (inspection and every conversion use it)."""
    from safetensors import safe_open

    shards = weight_shards(model_dir)
    if progress and len(shards) > 1:
        from tqdm.auto import tqdm

        shards = tqdm(shards, desc="shards")
    for shard in shards:
        try:
            with safe_open(shard, framework="pt") as f:
                meta = f.metadata() or {"format": "pt"}
                names = list(f.keys())

                def tensors(f=f, names=names, shard=shard):
                    for name in names:
                        try:
                            t = f.get_tensor(name)
                        except Exception as e:
                            raise unreadable_error(shard, e) from None
                        yield name, t

                yield shard, meta, tensors()
        except SparsityError:
            raise
        except Exception as e:
            raise unreadable_error(shard, e) from None


def check_masks_match_weights(path: str | os.PathLike, masks: dict[str, torch.Tensor]) -> None:
    """Refuse masks that do not belong to the weights saved beside them.

    hf_sparsity always saves weights with exact zeros at masked positions, so a checkpoint
    folder whose ``model.safetensors`` (or indexed shards) holds a nonzero where its mask file
    masks was put together from two runs (a mask file copied in from another model, or the
    weights replaced). ``path`` is the folder or the mask file inside it. Reads one tensor at a
    time. Nothing is checked where the folder has no safetensors weights, or for a mask whose
    tensor the weights lack (e.g. a DeepSpeed checkpoint keeps its weights elsewhere).
    """
    from safetensors import safe_open

    folder = Path(path) if os.path.isdir(path) else Path(path).parent
    index = folder / SAFE_WEIGHTS_INDEX_NAME
    by_file: dict[str, list[str]] = {}
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError):
            return  # not an index this check can read; loading the weights reports it
        for name in masks:
            if name in weight_map:
                by_file.setdefault(str(folder / weight_map[name]), []).append(name)
    elif (folder / SAFE_WEIGHTS_NAME).is_file():
        by_file[str(folder / SAFE_WEIGHTS_NAME)] = list(masks)
    for file, names in by_file.items():
        if not os.path.isfile(file):
            continue
        with safe_open(file, framework="pt") as f:
            stored = set(f.keys())
            for name in names:
                if name not in stored:
                    continue
                w = f.get_tensor(name)
                masked = masks[name] == 0
                if tuple(w.shape) != tuple(masked.shape):
                    raise SparsityError(
                        f"{file}: weight {name!r} has shape {list(w.shape)} but its mask "
                        f"{list(masked.shape)}; the mask file in {str(folder)!r} belongs to another model. "
                        "Use the mask file saved with these weights, or remove it to build fresh masks."
                    )
                bad = int(torch.count_nonzero(w[masked]))
                if bad:
                    raise SparsityError(
                        f"{file}: weight {name!r} is nonzero at {bad} of the {int(masked.sum())} positions "
                        f"its mask in {SPARSITY_MASKS_NAME} prunes, so that mask file was not saved with "
                        "these weights (copied from another checkpoint or model?). Use the mask file saved "
                        "with these weights, or remove it from the folder to build fresh masks."
                    )


def iter_tensors(model_dir: str | os.PathLike) -> Iterator[tuple[str, str, torch.Tensor]]:
    """Yield (shard_path, name, tensor) one tensor at a time, shard by shard."""
    for shard, _, tensors in iter_shards(model_dir):
        for name, t in tensors:
            yield shard, name, t


def inspect_checkpoint(model_dir: str | os.PathLike) -> dict[str, Any]:
    """Per-layer table for a model folder: every matrix (and every masked tensor) with shape, level, nonzeros.

    ``level`` is the mask's level where the folder has masks, else the measured fraction of
    exact zeros. Streams shard by shard.
    """
    masks = MaskReader(model_dir)
    rows, total, nonzero = [], 0, 0
    seen_masked = set()
    for _, name, t in iter_tensors(model_dir):
        n = t.numel()
        nz = int(torch.count_nonzero(t))
        total += n
        nonzero += nz
        if t.ndim < 2 and name not in masks:
            continue
        row = {
            "name": name,
            "shape": list(t.shape),
            "numel": n,
            "nonzeros": nz,
            "zero_fraction": 1 - nz / max(n, 1),
        }
        if name in masks:
            seen_masked.add(name)
            row["masked"] = True
            row["level"] = masks.info[name]["level"]
            if list(masks.info[name]["shape"]) != list(t.shape):
                raise SparsityError(
                    f"Mask {name!r} has shape {masks.info[name]['shape']} but the weight has {list(t.shape)}."
                )
        else:
            row["masked"] = False
            row["level"] = row["zero_fraction"]
        rows.append(row)
    missing = sorted(set(masks.names()) - seen_masked)
    if missing:
        raise SparsityError(
            f"{SPARSITY_MASKS_NAME} in {str(model_dir)!r} names tensors the weights lack (e.g. "
            f"{missing[0]!r})."
        )
    masked = [r for r in rows if r["masked"]]
    mt = sum(r["numel"] for r in masked)
    mz = sum(r["numel"] - r["nonzeros"] for r in masked)
    return {
        "model_dir": str(model_dir),
        "has_masks": masks.path is not None,
        "layers": rows,
        "totals": {
            "params": total,
            "nonzero_params": nonzero,
            "sparsity": 1 - nonzero / max(total, 1),
            "masked_tensors": len(masked),
            "masked_params": mt,
            "masked_sparsity": mz / mt if mt else 0.0,
        },
    }


def format_inspection(report: dict[str, Any]) -> str:
    rows = report["layers"]
    w = max([len(r["name"]) for r in rows] + [5])
    lines = [f"{'layer':<{w}}  {'shape':<14} {'masked':<6} {'level':>7} {'nonzeros':>12}"]
    for r in rows:
        lines.append(
            f"{r['name']:<{w}}  {'x'.join(map(str, r['shape'])):<14} {'yes' if r['masked'] else 'no':<6} "
            f"{r['level']:>7.4f} {r['nonzeros']:>12,}"
        )
    t = report["totals"]
    lines.append(
        f"total: {t['params']:,} params, {t['nonzero_params']:,} nonzero ({t['sparsity']:.2%} sparse); "
        f"{t['masked_tensors']} masked tensors, {t['masked_params']:,} params at {t['masked_sparsity']:.2%}"
    )
    return "\n".join(lines)


def read_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    path = os.path.join(str(model_dir), CONFIG_NAME)
    if not os.path.isfile(path):
        raise SparsityError(f"No {CONFIG_NAME} in {str(model_dir)!r}.")
    with open(path, encoding="utf-8") as f:
        return json.load(f)
