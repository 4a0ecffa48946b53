"""Resuming Trainer checkpoints: whether a ``checkpoint-N`` folder is complete, and which one to
resume from when a run was stopped while saving."""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

from ..constants import CONFIG_NAME, CONFIG_SECTION, SAFE_WEIGHTS_INDEX_NAME, SPARSITY_MASKS_NAME
from ..utils import SparsityError
from .folders import safetensors_error
from .masks_file import read_mask_metadata

logger = logging.getLogger(__name__)

TRAINER_STATE_NAME = "trainer_state.json"  # transformers' name; Trainer writes it last
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
_WEIGHT_FILES = ("model.safetensors", "adapter_model.safetensors", "pytorch_model.bin", "adapter_model.bin")


def _readable_safetensors(path: Path) -> bool:
    return safetensors_error(path) is None


def _weights_problem(d: Path) -> str | None:
    index = d / SAFE_WEIGHTS_INDEX_NAME
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, ValueError, KeyError):
            return f"{SAFE_WEIGHTS_INDEX_NAME} is unreadable"
        bad = sorted(s for s in shards if not _readable_safetensors(d / s))
        return f"weight shard {bad[0]} is missing or truncated" if bad else None
    for name in _WEIGHT_FILES:
        if (d / name).is_file():
            if name.endswith(".safetensors") and not _readable_safetensors(d / name):
                return f"{name} is truncated"
            return None
    return "no model weights"


def checkpoint_problem(checkpoint_dir: str | os.PathLike) -> str | None:
    """Why a Trainer checkpoint folder cannot be resumed from (``None``: it is complete).

    Trainer writes a checkpoint in this order: the weights and ``config.json``
    (``save_pretrained``, which also writes ``sparsity_masks.safetensors`` for a sparse
    run), then optimizer, scheduler and RNG states, then ``trainer_state.json`` last. A
    complete folder therefore has a readable ``trainer_state.json`` (for ``checkpoint-N``,
    at step N), readable weights and, when the run is sparse (the config has a
    ``sparsity`` section or the state records a :class:`~hf_sparsity.SparsityCallback`),
    a readable mask file. A process killed mid-save leaves a folder that fails one of these.
    """
    d = Path(checkpoint_dir)
    if not d.is_dir():
        return "not a folder"
    try:
        state = json.loads((d / TRAINER_STATE_NAME).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"no {TRAINER_STATE_NAME}"
    except (OSError, ValueError):
        return f"{TRAINER_STATE_NAME} is truncated"
    if not isinstance(state, dict):
        return f"{TRAINER_STATE_NAME} is not a Trainer state"
    m = _CHECKPOINT_RE.match(d.name)
    if m and state.get("global_step") != int(m.group(1)):
        return f"{TRAINER_STATE_NAME} records step {state.get('global_step')}, not {m.group(1)}"
    problem = _weights_problem(d)
    if problem:
        return problem
    try:
        config = json.loads((d / CONFIG_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    sparse = CONFIG_SECTION in config or "SparsityCallback" in (state.get("stateful_callbacks") or {})
    masks = d / SPARSITY_MASKS_NAME
    if masks.exists() or sparse:
        if not masks.is_file():
            return f"no {SPARSITY_MASKS_NAME}"
        try:
            read_mask_metadata(masks)
        except SparsityError:
            return f"{SPARSITY_MASKS_NAME} is truncated or corrupt"
    return None


def _checkpoints(output_dir: Path) -> list[Path]:
    """``checkpoint-N`` folders of a run, newest (highest N) first."""
    if not output_dir.is_dir():
        return []
    found = [p for p in output_dir.iterdir() if p.is_dir() and _CHECKPOINT_RE.match(p.name)]
    return sorted(found, key=lambda p: int(_CHECKPOINT_RE.match(p.name).group(1)), reverse=True)


def last_complete_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The newest ``checkpoint-N`` folder in ``output_dir`` that is complete (see
    :func:`checkpoint_problem`), or ``None`` when there is none.

    Newer folders left partial (a run killed while saving) are skipped, each named in a
    logged warning. Pass the result to ``trainer.train(resume_from_checkpoint=...)``:
    ``resume_from_checkpoint=True`` would take the newest folder, complete or not.
    """
    partial = []
    for ckpt in _checkpoints(Path(output_dir)):
        problem = checkpoint_problem(ckpt)
        if problem is None:
            if partial:
                logger.warning(
                    "Skipping partial checkpoint(s) %s (a run stopped while saving); resuming from %s.",
                    "; ".join(partial),
                    ckpt,
                )
            return str(ckpt)
        partial.append(f"{ckpt} ({problem})")
    if partial:
        logger.warning("No complete checkpoint in %s; partial: %s.", output_dir, "; ".join(partial))
    return None


def resume_checkpoint(output_dir: str | os.PathLike, resume: bool | str | os.PathLike | None) -> str | None:
    """The folder to resume from: ``resume`` True -> :func:`last_complete_checkpoint` of
    ``output_dir``; a path -> that folder, refused with a :class:`SparsityError` naming the last
    complete checkpoint when it is partial; False / None -> ``None`` (start fresh)."""
    if resume is None or resume is False:
        return None
    if resume is True:
        return last_complete_checkpoint(output_dir)
    problem = checkpoint_problem(resume)
    if problem is None:
        return str(resume)
    parent = Path(resume).parent
    last = last_complete_checkpoint(parent)
    fix = f"resume from {last} instead" if last else f"{str(parent)!r} holds no complete one; start over"
    raise SparsityError(f"Checkpoint {str(resume)!r} is incomplete ({problem}): {fix}.")
