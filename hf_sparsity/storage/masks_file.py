"""``sparsity_masks.safetensors``: bit-packed masks keyed by parameter name.

Format (version 1)
------------------
* One uint8 tensor per sparsified parameter, keyed by its name in
  ``model.named_parameters()`` (no DDP ``module.`` prefix).
* The mask is viewed as 2-D ``(rows, cols)``: ``rows = shape[0]`` and ``cols`` the
  product of the remaining dims (a 1-D mask is ``(1, n)``). Each row is packed to
  ``ceil(cols / 8)`` bytes, little bit order: bit ``j`` of byte ``b`` is column
  ``8*b + j``. A set bit means the weight is kept (trainable); a clear bit, pruned.
* Safetensors metadata (all strings): ``format`` = ``hf_sparsity.masks``,
  ``format_version`` = ``1``, ``library_version``, and ``tensors``: JSON
  ``{name: {"shape": [...], "level": float, "nonzeros": int}}``; ``checksum`` =
  ``sha256:<hex>`` over every mask's name, shape and packed bytes, in name order (see
  :func:`mask_checksum`); plus any extra keys the writer adds (``state``: the engine's step count
  and events; ``source``, ...).
  Files without ``checksum`` (written before it existed) load with a warning.

A 2-D mask therefore costs ``ceil(cols/8)/cols`` ~ 0.125 bytes per parameter on disk.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from ..constants import MASK_FORMAT_NAME, MASK_FORMAT_VERSION, SPARSITY_MASKS_NAME
from ..masks import MASK_DTYPE
from ..modeling import full_shape
from ..utils import SparsityError, atomic_path, library_version

logger = logging.getLogger(__name__)

CHECKSUM_KEY = "checksum"
_warned_unchecked: set[str] = set()


def _as_2d(shape) -> tuple[int, int]:
    shape = tuple(int(s) for s in shape)
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    cols = 1
    for s in shape[1:]:
        cols *= s
    return shape[0], cols


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """uint8 {0,1} mask of any shape -> ``(rows, ceil(cols/8))`` uint8 on the CPU, little bit order.

    A mask on an accelerator is packed there (:func:`pack_bits`), so one byte in eight crosses to the host.
    """
    rows, cols = _as_2d(mask.shape)
    if mask.device.type != "cpu":
        return pack_bits(mask.detach().reshape(rows, cols)).cpu()
    arr = mask.detach().to(MASK_DTYPE).reshape(rows, cols).numpy().astype(bool)
    return torch.from_numpy(np.packbits(arr, axis=1, bitorder="little"))


def pack_bits(mask2d: torch.Tensor) -> torch.Tensor:
    """``(rows, cols)`` mask -> ``(rows, ceil(cols/8))`` uint8 on the mask's own device, little bit order
    (bit ``j`` of byte ``b`` is column ``8*b + j``: the bytes ``numpy.packbits(..., bitorder="little")``
    writes), in uint8 throughout."""
    rows, cols = mask2d.shape
    bits = (mask2d != 0).to(torch.uint8)
    if cols % 8:
        bits = torch.nn.functional.pad(bits, (0, 8 - cols % 8))
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return (bits.view(rows, -1, 8) << shifts).sum(-1, dtype=torch.uint8)


def unpack_mask(packed: torch.Tensor, shape) -> torch.Tensor:
    rows, cols = _as_2d(shape)
    nbytes = (cols + 7) // 8
    if tuple(packed.shape) != (rows, nbytes) or packed.dtype != torch.uint8:
        raise SparsityError(
            f"Packed mask has shape {tuple(packed.shape)} ({packed.dtype}) but a {list(shape)} mask needs "
            f"({rows}, {nbytes}) uint8. The mask file is corrupt or from another model; rebuild it."
        )
    bits = np.unpackbits(packed.numpy(), axis=1, count=cols, bitorder="little")
    return torch.from_numpy(bits.astype(np.uint8)).reshape(*[int(s) for s in shape])


def save_masks(
    path: str | os.PathLike,
    masks: Mapping[str, torch.Tensor],
    extra_metadata: Mapping[str, Any] | None = None,
) -> str:
    """Write ``masks`` (name -> uint8 mask) bit-packed to ``path`` (a file, or a folder for the default name).

    The write is atomic: a temporary file renamed into place.
    """
    from safetensors.torch import save_file

    path = str(path)
    if os.path.isdir(path):
        path = os.path.join(path, SPARSITY_MASKS_NAME)
    tensors, info = {}, {}
    for name in masks:
        if hasattr(masks, "packed"):  # masks held packed already (streamed pruning): written as they are
            tensors[name], nnz = masks.packed(name)
            shape = list(masks.shape(name))
        else:
            mask = masks[name]
            tensors[name] = pack_mask(mask).contiguous()
            nnz, shape = int(mask.sum(dtype=torch.int64)), list(mask.shape)
        numel = 1
        for d in shape:
            numel *= d
        info[name] = {"shape": shape, "level": 1.0 - nnz / max(numel, 1), "nonzeros": nnz}
    metadata = {
        "format": MASK_FORMAT_NAME,
        "format_version": str(MASK_FORMAT_VERSION),
        "library_version": library_version(),
        "tensors": json.dumps(info, sort_keys=True),
        CHECKSUM_KEY: mask_checksum(info, tensors.__getitem__),
    }
    for k, v in (extra_metadata or {}).items():
        metadata[k] = v if isinstance(v, str) else json.dumps(v)
    with atomic_path(path) as tmp:
        save_file(tensors, tmp, metadata=metadata)
    return path


def mask_checksum(info: Mapping[str, Any], packed: Callable[[str], torch.Tensor]) -> str:
    """``sha256:<hex>`` over each mask's name, shape and packed bytes, in sorted name order.

    ``packed(name)`` returns the stored uint8 tensor; one is read at a time. Unlike the nonzero
    counts, this catches changes that keep the count (two bits swapped).
    """
    h = hashlib.sha256()
    for name in sorted(info):
        h.update(name.encode("utf-8") + b"\0")
        h.update(json.dumps([int(s) for s in info[name]["shape"]]).encode("ascii") + b"\0")
        h.update(packed(name).contiguous().numpy().tobytes())
    return "sha256:" + h.hexdigest()


def verify_checksum(path: str, meta: Mapping[str, Any], packed: Callable[[str], torch.Tensor]) -> None:
    """Refuse a mask file whose bytes do not match its recorded checksum; warn (once per file) about
    files written before checksums existed."""
    recorded = meta.get(CHECKSUM_KEY)
    if recorded is None:
        if path not in _warned_unchecked:
            _warned_unchecked.add(path)
            logger.warning(
                "%s has no checksum (written by an older hf_sparsity); its masks cannot be verified. "
                "Re-save it (load the model with its masks and save_pretrained) to add one.",
                path,
            )
        return
    actual = mask_checksum(meta["tensors"], packed)
    if actual != recorded:
        raise SparsityError(
            f"Mask file {path!r} is corrupt: its contents do not match the checksum in its metadata. "
            "Restore it from the checkpoint it came from (or a backup), or delete it to rebuild the masks."
        )


def read_mask_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The file's metadata with ``tensors`` parsed; raises a clear error on a bad file."""
    from safetensors import safe_open

    path = _resolve(path)
    try:
        with safe_open(path, framework="pt") as f:
            meta = dict(f.metadata() or {})
            keys = set(f.keys())
    except Exception as e:  # safetensors raises its own error types for truncated/corrupt headers
        raise SparsityError(
            f"Cannot read mask file {path!r} ({e}). It is truncated or corrupt: restore it from the "
            "checkpoint "
            "it came from, or rebuild the masks."
        ) from None
    if meta.get("format") != MASK_FORMAT_NAME:
        raise SparsityError(
            f"{path!r} is not an hf_sparsity mask file (metadata format={meta.get('format')!r})."
        )
    version = int(meta.get("format_version", "0"))
    if version > MASK_FORMAT_VERSION:
        raise SparsityError(
            f"{path!r} uses mask format version {version}; this hf_sparsity reads up to "
            f"{MASK_FORMAT_VERSION}. "
            "Upgrade hf_sparsity."
        )
    try:
        meta["tensors"] = json.loads(meta["tensors"])
    except (KeyError, json.JSONDecodeError):
        raise SparsityError(f"{path!r} has no readable `tensors` metadata; the file is corrupt.") from None
    if set(meta["tensors"]) != keys:
        raise SparsityError(f"{path!r}: metadata and stored tensors disagree; the file is corrupt.")
    return meta


def load_masks(
    path: str | os.PathLike, expected_shapes: Mapping[str, tuple[int, ...]] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read masks (name -> uint8 tensor) and metadata. With ``expected_shapes``, check names and shapes."""
    from safetensors import safe_open

    path = _resolve(path)
    meta = read_mask_metadata(path)
    info = meta["tensors"]
    if expected_shapes is not None:
        check_mask_names(info, expected_shapes, path)
    masks = {}
    try:
        with safe_open(path, framework="pt") as f:
            packed = {name: f.get_tensor(name) for name in info}
        verify_checksum(path, meta, packed.__getitem__)
        for name, t in info.items():
            masks[name] = unpack_mask(packed[name], t["shape"])
    except SparsityError:
        raise
    except Exception as e:
        raise SparsityError(
            f"Cannot read mask tensors from {path!r} ({e}); the file is truncated or corrupt."
        ) from None
    for name, m in masks.items():
        nnz = int(m.sum(dtype=torch.int64))
        if nnz != info[name]["nonzeros"]:
            raise SparsityError(
                f"{path!r}: mask {name!r} has {nnz} nonzeros but its metadata says {info[name]['nonzeros']}; "
                "the file is corrupt."
            )
    return masks, meta


def has_masks(directory: str | os.PathLike | None) -> bool:
    """True when ``directory`` is a folder holding a mask file (or is a mask file)."""
    if not directory:
        return False
    path = str(directory)
    return os.path.isfile(os.path.join(path, SPARSITY_MASKS_NAME)) or (
        os.path.isfile(path) and path.endswith(".safetensors")
    )


def load_masks_for(
    model: torch.nn.Module,
    directory: str | os.PathLike,
    *,
    required: bool = False,
    with_metadata: bool = False,
) -> Any:
    """The masks stored for ``model`` in ``directory`` (a model folder or a mask file): the one way
    every part of the library loads them (callback, engine, evaluation, inference, checkpoint tools).

    Names and shapes are checked against ``model``'s parameters. Returns name -> uint8 mask, or
    ``None`` when the folder has no mask file (an error instead with ``required``);
    ``with_metadata`` returns ``(masks, metadata)``.
    """
    if not has_masks(directory):
        if required:
            _resolve(directory)  # raises the "no mask file" error
        return (None, {}) if with_metadata else None
    shapes = {n: tuple(full_shape(p)) for n, p in model.named_parameters()}
    masks, meta = load_masks(directory, expected_shapes=shapes)
    return (masks, meta) if with_metadata else masks


def mask_levels(path: str | os.PathLike) -> dict[str, float]:
    """Per-tensor levels recorded in a mask file's metadata (nothing unpacked)."""
    out = {}
    for name, t in read_mask_metadata(path)["tensors"].items():
        numel = 1
        for s in t["shape"]:
            numel *= int(s)
        out[name] = 1.0 - int(t["nonzeros"]) / numel if numel else 0.0
    return out


def check_mask_names(
    info: Mapping[str, Any], expected: Mapping[str, tuple[int, ...]], path: str = "masks"
) -> None:
    missing = sorted(set(info) - set(expected))
    if missing:
        raise SparsityError(
            f"{path}: masks for {len(missing)} parameter(s) the model does not have (e.g. {missing[0]!r}). "
            "The mask file belongs to another model or naming; load the matching model, or rebuild the masks."
        )
    for name, t in info.items():
        want = tuple(int(s) for s in expected[name])
        got = tuple(int(s) for s in t["shape"])
        if want != got:
            raise SparsityError(
                f"{path}: mask {name!r} has shape {list(got)} but the parameter has {list(want)}. "
                "The mask file belongs to another model size; use the matching checkpoint or rebuild the "
                "masks."
            )


def _resolve(path: str | os.PathLike) -> str:
    path = str(path)
    if os.path.isdir(path):
        path = os.path.join(path, SPARSITY_MASKS_NAME)
    if not os.path.isfile(path):
        raise SparsityError(f"No mask file at {path!r}. Point to a folder holding {SPARSITY_MASKS_NAME}.")
    return path
