"""The config-only path: a model built on the ``meta`` device, counted (:func:`count_flops_from_config`)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from torch import nn

from ..constants import CONFIG_NAME, SPARSITY_MASKS_NAME
from ..mask_engine.config import SparsityConfig, get_sparsity_config
from ..modeling import architecture_builder, meta_causal_lm
from ..storage.masks_file import mask_levels
from ..utils import SparsityError
from .counting import (
    count_flops,
)
from .report import FlopReport


def load_config(source: Any):
    """A ``PretrainedConfig`` from a config object, a dict, a ``config.json`` path or a model directory."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(source, PretrainedConfig):
        return source
    if isinstance(source, Mapping):
        data = dict(source)
    else:
        path = str(source)
        if os.path.isdir(path):
            path = os.path.join(path, CONFIG_NAME)
        if not os.path.isfile(path):
            raise SparsityError(
                f"No config at {str(source)!r}. Give a config.json path or a model directory."
            )
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except json.JSONDecodeError as e:
            raise SparsityError(f"{path!r} is not valid JSON ({e}).") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise SparsityError(
            f'The config {str(source)[:200]!r} has no `model_type`; it needs one (e.g. "gpt2", "llama") '
            "so the architecture can be built."
        )
    data = dict(data)
    model_type = data.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **data)
    except ValueError as e:
        raise SparsityError(f"Unknown model_type {model_type!r} ({e}).") from None


def build_meta_model(config: Any) -> nn.Module:
    """Instantiate the causal LM of ``config`` (a config, folder or dict) on the ``meta`` device.

    A config with an architecture section registered in :mod:`hf_sparsity.modeling` builds that
    architecture (a Sparse-IFT config, with its ``sparse_ift`` section, its transformed layers).
    """
    config = load_config(config)
    return meta_causal_lm(config, architecture_builder(config))


def mask_levels_from_file(path: str | os.PathLike) -> dict[str, float]:
    """Per-tensor levels recorded in a ``sparsity_masks.safetensors`` (metadata only; nothing unpacked)."""
    return mask_levels(path)


def count_flops_from_config(
    config: Any,
    sparsity: float | SparsityConfig | dict | Mapping[str, float] | None = None,
    *,
    seq_len: int | None = None,
    use_masks: bool = True,
) -> FlopReport:
    """FLOPs and parameters from a config alone (a path, a model directory, a dict or a ``PretrainedConfig``).

    The model is built on the ``meta`` device, so this works for models far too large
    to instantiate. ``sparsity``: a level or a :class:`SparsityConfig` (planned with the
    targeting rules), or a mapping of parameter name -> level. With ``None``: the masks
    file of a model directory (when ``use_masks``), else the config's own sparsity
    section, else dense.
    """
    model = build_meta_model(config)
    if sparsity is None:
        if use_masks and isinstance(config, (str, os.PathLike)) and os.path.isdir(config):
            if os.path.isfile(os.path.join(config, SPARSITY_MASKS_NAME)):
                return count_flops(model, levels=mask_levels_from_file(config), seq_len=seq_len)
        section = get_sparsity_config(model.config)
        return count_flops(model, sparsity=section, seq_len=seq_len)
    if isinstance(sparsity, Mapping) and not _is_section(sparsity):
        return count_flops(model, levels=sparsity, seq_len=seq_len)
    return count_flops(model, sparsity=sparsity, seq_len=seq_len)


def _is_section(d: Mapping) -> bool:
    keys = {"sparsity", "param_name_patterns", "param_filter", "groups", "init_method", "seed", "algorithm"}
    return bool(set(d) & keys)
