"""``merge_sparse``: merge a LoRA adapter into a sparse base and keep its masks exact.

It sits above the mask engine and :mod:`hf_sparsity.lora` (the engine's view of a peft model, which
the engine and the targeting rules import): it builds an engine, reads the config and writes a
finalized section.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..constants import SPARSITY_MASKS_NAME
from ..lora.masked import remove_masked_mode
from ..lora.view import PeftBaseView, engine_state, is_peft_model
from ..mask_engine.config import SparsityConfig, get_sparsity_config
from ..mask_engine.engine import SparsityEngine
from ..masks import mask_level
from ..modeling import apply_masks
from ..storage.masks_file import check_mask_names, load_masks_for
from ..utils import SparsityError, atomic_dir
from .finalize import levels_section

logger = logging.getLogger(__name__)


def _masks_for(peft_model: nn.Module, view: PeftBaseView, masks: Any):
    """(masks, config or None, where they came from): explicit, from an engine, or the base folder's file."""
    if isinstance(masks, (str, os.PathLike)):
        return load_masks_for(view, masks, required=True), get_sparsity_config(view.config), str(masks)
    if masks is not None:
        shapes = {n: tuple(p.shape) for n, p in view.named_parameters()}
        check_mask_names({n: {"shape": list(m.shape)} for n, m in masks.items()}, shapes)
        return dict(masks), get_sparsity_config(view.config), "masks argument"
    attached = engine_state(peft_model)
    if attached and attached[0].masks:
        return dict(attached[0].masks), attached[1], "the SparsityCallback / SparsityEngine"
    source = getattr(view.config, "name_or_path", None)
    loaded = load_masks_for(view, source) if source and os.path.isdir(str(source)) else None
    if loaded is not None:
        return loaded, get_sparsity_config(view.config), str(source)
    raise SparsityError(
        f"merge_sparse: {type(view.base).__name__} has no masks: no SparsityCallback/SparsityEngine ran on "
        "it "
        f"and its base folder ({source!r}) holds no {SPARSITY_MASKS_NAME}. Pass the masks: "
        "merge_sparse(model, masks='SPARSE_BASE_DIR'), or merge with peft's merge_and_unload() for a dense "
        "model."
    )


@torch.no_grad()
def merge_sparse(
    peft_model: nn.Module,
    masks: Mapping[str, torch.Tensor] | str | os.PathLike | None = None,
    *,
    output_dir: str | os.PathLike | None = None,
    overwrite: bool = False,
) -> nn.Module:
    """Merge the LoRA adapters into the base weights and re-apply the masks exactly.

    ``masks``: name -> mask with the base model's names, or a folder / mask file; by
    default the masks of the SparsityCallback / SparsityEngine that trained the model,
    else the base folder's ``sparsity_masks.safetensors``. Returns the merged
    ``transformers`` model: masked weights exactly 0, and ``save_pretrained`` writes the
    mask file and the config's ``sparsity`` section (so ``hf_sparsity convert --finalize``
    and resumed sparse training take it as is). With ``output_dir`` it is also saved
    there, atomically. Nothing is merged (and nothing written) when the masks are missing
    or do not fit.
    """
    if not is_peft_model(peft_model):
        raise SparsityError(
            f"merge_sparse needs a peft PeftModel (get_peft_model(...)), got {type(peft_model).__name__}."
        )
    if output_dir is not None and os.path.exists(output_dir) and not overwrite:
        raise SparsityError(
            f"Output folder {str(output_dir)!r} already exists. Choose another path or pass overwrite=True."
        )
    view = PeftBaseView(peft_model)
    mask_dict, config, source = _masks_for(peft_model, view, masks)
    if not mask_dict:
        raise SparsityError(
            f"merge_sparse: the masks from {source} are empty; there is nothing to keep sparse."
        )
    if config is None:  # masks without a config: one anchored pattern per tensor, at its level
        info = {n: {"level": mask_level(m)} for n, m in mask_dict.items()}
        config = SparsityConfig.from_dict(levels_section(info))
    merged = peft_model.merge_and_unload()
    remove_masked_mode(merged)
    apply_masks(merged, mask_dict)
    trained = (engine_state(peft_model) or (None,))[0]
    engine = SparsityEngine(merged, config, strict=False)
    if trained is not None:  # the card and a resumed run see the steps and events of the LoRA run
        engine.optimizer_steps, engine.events = trained.optimizer_steps, list(trained.events)
    engine.set_masks(mask_dict)
    engine.install_save_hook()
    engine.stamp_config()
    logger.info("merge_sparse: merged with %d exact masks from %s.", len(mask_dict), source)
    if output_dir is not None:
        with atomic_dir(output_dir, overwrite=overwrite) as tmp:
            merged.save_pretrained(str(tmp))
    return merged


__all__ = ["merge_sparse"]
