"""Open a model folder: the one loader (masks applied, dtype, device) and the one table of dtype names.

Every command and library entry point that reads a folder written by ``save_pretrained`` goes
through :func:`load_model_folder`, and every ``--dtype`` / ``dtype=`` name through
:func:`resolve_dtype`, so they accept the same names and give the same errors.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .constants import SPARSITY_MASKS_NAME
from .modeling import CONTEXT_KEYS, apply_masks
from .storage.folders import check_weights_readable
from .storage.masks_file import load_masks_for
from .utils import SparsityError

logger = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float64": torch.float64,
    "fp64": torch.float64,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
"""The dtype names accepted wherever a dtype is given as text (``--dtype``, ``dtype="bf16"``)."""


def resolve_dtype(
    dtype: str | torch.dtype | None, allowed: tuple[str, ...] | None = None, flag: str = "dtype"
) -> torch.dtype | None:
    """A dtype name from :data:`DTYPES` (or a ``torch.dtype``, or ``None``) -> the ``torch.dtype``.

    ``allowed``: the names a caller supports, when it supports fewer than :data:`DTYPES`.
    ``flag``: how the error names the setting (``"--dtype"`` in a command).
    """
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    names = allowed or tuple(DTYPES)
    if str(dtype) not in names or str(dtype) not in DTYPES:
        raise SparsityError(f"Unknown {flag} {dtype!r}; use one of {', '.join(sorted(names))}.")
    return DTYPES[str(dtype)]


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """``None``/``"auto"`` -> CUDA when available, else CPU."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_model_folder(
    path: str | os.PathLike,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    masks: bool = True,
    **from_pretrained_kwargs: Any,
) -> tuple[nn.Module, dict[str, torch.Tensor] | None]:
    """``AutoModelForCausalLM.from_pretrained(path)`` with the folder's masks applied; ``(model, masks)``.

    ``dtype``: a name from :data:`DTYPES`, a ``torch.dtype``, ``"auto"`` or ``None`` (as saved).
    ``device``: where the model goes (``None``: it stays where ``from_pretrained`` put it).
    ``masks``: apply ``sparsity_masks.safetensors`` when the folder has one (a vanilla or
    finalized folder has none: ``masks`` comes back ``None``). The model is in eval mode.
    """
    from transformers import AutoModelForCausalLM

    path = check_model_folder(path)
    if dtype is not None:
        from_pretrained_kwargs["dtype"] = dtype if dtype == "auto" else resolve_dtype(dtype)
    model = AutoModelForCausalLM.from_pretrained(str(path), **from_pretrained_kwargs)
    found = load_masks_for(model, path) if masks else None
    if found is not None:
        apply_masks(model, found)
        logger.info("applied %d masks from %s", len(found), path / SPARSITY_MASKS_NAME)
    if device is not None:
        model.to(resolve_device(device))
    return model.eval(), found


def load_sparse_model(model_dir: str | os.PathLike, **from_pretrained_kwargs: Any):
    """:func:`load_model_folder` as the package root offers it: ``(model, masks)``, ``masks`` empty
    (``{}``) for a folder without a mask file. ``dtype=`` is a name from :data:`DTYPES` or a
    ``torch.dtype``; the other keywords go to ``from_pretrained``."""
    model, masks = load_model_folder(model_dir, **from_pretrained_kwargs)
    return model, masks or {}


def load_tokenizer(tokenizer: Any, model_dir: str | os.PathLike) -> Any:
    """A tokenizer object as is, else the tokenizer saved in the folder ``tokenizer`` or ``model_dir``."""
    from transformers import AutoTokenizer

    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    try:
        return AutoTokenizer.from_pretrained(str(tokenizer or model_dir))
    except Exception as e:  # a folder saved without its tokenizer
        raise SparsityError(
            f"No tokenizer could be loaded from {str(tokenizer or model_dir)!r} ({type(e).__name__}: {e}). "
            "Save the tokenizer into the model folder or pass --tokenizer DIR."
        ) from None


# ---------------------------------------------------------------------------- checks of a folder
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_model_folder(path: str | os.PathLike | None, flag: str = "MODEL", weights: bool = True) -> Path:
    """A folder written by ``save_pretrained``: it exists, holds ``config.json`` and (if ``weights``)
    weights."""
    if not path:
        raise SparsityError(f"Give {flag}: a model folder written by save_pretrained.")
    p = Path(path)
    if not p.exists():
        raise SparsityError(
            f"{flag} {str(path)!r} does not exist. Give a model folder written by save_pretrained."
        )
    if not p.is_dir():
        raise SparsityError(
            f"{flag} {str(path)!r} is a file, not a folder. Give the model folder that holds it."
        )
    if not (p / "config.json").is_file():
        raise SparsityError(
            f"{flag} {str(path)!r} has no config.json: it is not a model folder. Give a folder written by "
            "save_pretrained (e.g. a checkpoint-N/ folder)."
        )
    if weights and not any((p / f).is_file() for f in WEIGHT_FILES):
        raise SparsityError(
            f"{flag} {str(path)!r} has a config.json but no weights ({' / '.join(WEIGHT_FILES[:3])}). "
            "Save the model with model.save_pretrained(DIR) or point at the checkpoint folder that has them."
        )
    if weights and any((p / f).is_file() for f in WEIGHT_FILES[:2]):
        check_weights_readable(p)  # a truncated file: inspect's one-line error, not a loader traceback
    return p


def check_tokenizer_source(model: str, tokenizer: str | None = None) -> str:
    """The folder the tokenizer comes from: ``--tokenizer`` if given, else the model folder; it must hold
    one."""
    src = tokenizer or model
    flag = "--tokenizer" if tokenizer else "MODEL"
    p = Path(src)
    if tokenizer and not p.exists():
        raise SparsityError(
            f"--tokenizer {tokenizer!r} does not exist. Give a folder that holds tokenizer.json."
        )
    if p.is_dir() and not any((p / f).is_file() for f in TOKENIZER_FILES):
        fix = "pass --tokenizer DIR" if not tokenizer else "give a folder with tokenizer.json"
        raise SparsityError(
            f"No tokenizer in {flag} {src!r} (none of {', '.join(TOKENIZER_FILES)}): "
            f"save it with tokenizer.save_pretrained(DIR) or {fix}."
        )
    return src


def check_context_fits(model: str, context: int | None, flag: str = "--context") -> None:
    """``--context`` no longer than the positions the model has (else an index error deep in the model)."""
    if not context:
        return
    import json

    cfg = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
    for key in CONTEXT_KEYS:  # the keys and order modeling.context_length reads
        limit = cfg.get(key)
        if isinstance(limit, int) and limit > 0:
            if context > limit:
                raise SparsityError(
                    f"{flag} {context} is longer than the model's {key}={limit}; use at most {limit}."
                )
            return


def check_device(name: str | None) -> None:
    """``cpu``, ``cuda``, ``cuda:N``, ``mps``: the device must exist on this machine."""
    if name is None:
        return
    import torch

    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise SparsityError(f"--device {name!r} is not a device name. Use cpu, cuda or cuda:N.") from None
    if dev.type == "cpu":
        return
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise SparsityError(f"--device {name!r}: no CUDA GPU is available here. Use --device cpu.")
        if dev.index is not None and dev.index >= n:
            raise SparsityError(
                f"--device {name!r}: this machine has {n} CUDA device(s) (cuda:0..cuda:{n - 1})."
            )
        return
    if dev.type == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise SparsityError(f"--device {name!r}: MPS is not available here. Use --device cpu.")
        return
    raise SparsityError(f"--device {name!r} is not supported. Use cpu, cuda or cuda:N.")


__all__ = [
    "DTYPES",
    "check_context_fits",
    "check_device",
    "check_model_folder",
    "check_tokenizer_source",
    "load_model_folder",
    "load_sparse_model",
    "load_tokenizer",
    "resolve_device",
    "resolve_dtype",
]
