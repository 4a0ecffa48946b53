"""What the library needs to know about a model's modules, in one place.

Linear-like layers (``nn.Linear`` and transformers' GPT-2 ``Conv1D``, which stores its
weight ``[in, out]``), their dimensions, swapping a submodule, the context length of a
config, a model built on the ``meta`` device, DTensor (FSDP2) views of a parameter,
applying masks to weights, and the per-layer sparsity table every report prints.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from . import zero
from .utils import SparsityError

DEFAULT_CONTEXT_LENGTH = 2048
CONTEXT_KEYS = (
    "n_positions",
    "max_position_embeddings",
    "n_ctx",
    "max_sequence_length",
    "seq_length",
    "max_seq_len",
)


# ---------------------------------------------------------------------- linear-like layers
def is_conv1d(module: nn.Module) -> bool:
    """True for ``transformers.pytorch_utils.Conv1D`` (GPT-2 family), matched by class name so that
    copies of it in remote code count too."""
    return type(module).__name__ == "Conv1D"


def linear_kind(module: nn.Module) -> str | None:
    """``"Linear"``, ``"Conv1D"`` or ``None`` (not a linear-like layer)."""
    if isinstance(module, nn.Linear):
        return "Linear"
    if is_conv1d(module):
        return "Conv1D"
    return None


def linear_dims(module: nn.Module) -> tuple[int, int] | None:
    """``(d_in, d_out)`` of a linear-like module, or ``None``."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if is_conv1d(module) and getattr(module, "weight", None) is not None:  # weight is [in, out]
        shape = full_shape(module.weight)
        return int(shape[0]), int(shape[1])
    return None


def input_dim(module: nn.Module) -> int:
    """The weight dimension a linear-like layer multiplies along: 1 for ``nn.Linear``, 0 for ``Conv1D``."""
    return 0 if is_conv1d(module) else 1


def replace_module(model: nn.Module, name: str, new: nn.Module) -> nn.Module:
    """Put ``new`` at dotted path ``name`` of ``model``; returns the module it replaced."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, child)
    setattr(parent, child, new)
    return old


# ---------------------------------------------------------------------- configs
def context_length(config: Any, default: int = DEFAULT_CONTEXT_LENGTH) -> int:
    """The longest sequence a config's model takes (``n_positions``, ``max_position_embeddings``, ...)."""
    for key in CONTEXT_KEYS:
        v = getattr(config, key, None) if config is not None else None
        if isinstance(v, int) and v > 0:
            return v
    return default


def check_token_ids(config: Any, ids: torch.Tensor, tokenizer_dir: str | os.PathLike) -> None:
    """Refuse token ids past the vocabulary of a model's ``config`` (a tokenizer from another model):
    the embedding lookup would fail with an index error deep inside the forward."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rows = getattr(text, "vocab_size", None)
    top = int(ids.max()) if ids.numel() else -1
    if isinstance(rows, int) and top >= rows:
        raise SparsityError(
            f"The tokenizer in {str(tokenizer_dir)!r} gives token id {top}, but the model's embedding has "
            f"{rows} rows: the tokenizer belongs to another model. Save the model's own tokenizer there "
            "(tokenizer.save_pretrained(DIR))."
        )


def _no_zero3_init():
    """A context in which transformers builds models without ``deepspeed.zero.Init``.

    Under a ZeRO-3 Trainer, transformers wraps every ``from_config`` in ``zero.Init``, a collective:
    a meta model built on one rank only (a model card, a FLOP count) would wait for the others
    forever. transformers' own guard against nested ``zero.Init`` (``set_zero3_state``) switches it
    off for the block; without it (an older transformers) nothing needs switching off.
    """
    try:
        from transformers.modeling_utils import set_zero3_state
    except ImportError:
        return contextlib.nullcontext()
    return set_zero3_state()


# Config sections that change the architecture a config builds -> the builder of that architecture.
# Sparse-IFT registers its ``sparse_ift`` section (hf_sparsity.ift.models, imported with the package);
# the layers below it (the FLOP counter's config-only path) build any registered architecture
# without importing the layers above that define it.
_ARCHITECTURES: dict[str, Callable[[Any], nn.Module]] = {}


def register_architecture(section: str, build: Callable[[Any], nn.Module]) -> None:
    """Build configs that carry a ``section`` with ``build(config)`` (one builder per section)."""
    old = _ARCHITECTURES.get(section)
    if old is not None and (old.__module__, old.__qualname__) != (build.__module__, build.__qualname__):
        raise SparsityError(
            f"Config section {section!r} already has a builder ({old.__module__}.{old.__qualname__}); "
            "register each section once."
        )
    _ARCHITECTURES[section] = build


def architecture_builder(config: Any) -> Callable[[Any], nn.Module] | None:
    """The registered builder of the first architecture section ``config`` carries; None: the stock class."""
    for section, build in _ARCHITECTURES.items():
        if getattr(config, section, None):
            return build
    return None


def meta_causal_lm(config: Any, build: Any = None) -> nn.Module:
    """The causal LM of a transformers ``config`` on the ``meta`` device: real shapes, no memory.

    ``build(config)`` makes the model (default ``AutoModelForCausalLM.from_config``).
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # meta init warnings are noise here
    try:
        with torch.device("meta"), _no_zero3_init():
            return (build or AutoModelForCausalLM.from_config)(config)
    except SparsityError:
        raise
    except Exception as e:
        raise SparsityError(f"Cannot build a causal LM from the {config.model_type!r} config: {e}") from None
    finally:
        hf_logging.set_verbosity(verbosity)


# ---------------------------------------------------------------------- sharded parameters
# FSDP2 (DTensor) and DeepSpeed ZeRO-3 (``ds_tensor``) parameters: this rank holds a shard.
def is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor" or hasattr(t, "to_local") and hasattr(t, "placements")


def is_sharded(t: torch.Tensor) -> bool:
    """True when this rank holds only a shard of ``t`` (FSDP2 DTensor, DeepSpeed ZeRO-3)."""
    return is_dtensor(t) or zero.is_zero3(t)


def full_shape(t: torch.Tensor) -> torch.Size:
    """The whole tensor's shape, whatever this rank holds of it."""
    return zero.full_shape(t)


def full_numel(t: torch.Tensor) -> int:
    return int(full_shape(t).numel())


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor or of a ZeRO-3 parameter (flat); the tensor itself otherwise."""
    if is_dtensor(t):
        return t.to_local()
    return t.ds_tensor if zero.is_zero3(t) else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor, gathering shards (a collective for sharded ones: every rank must call it).

    Under DeepSpeed ZeRO the fp32 master weight (what a single process holds)."""
    if is_dtensor(t):
        return t.full_tensor()
    return zero.gather_full(t) if zero.is_zero(t) else t


# ---------------------------------------------------------------------- masks on weights
@torch.no_grad()
def apply_masks(model: nn.Module, masks: Mapping[str, torch.Tensor]) -> int:
    """Multiply each masked weight by its mask in place; returns how many tensors were masked."""
    for name, mask in masks.items():
        p = model.get_parameter(name)
        p.mul_(mask.to(device=p.device, dtype=p.dtype))
    return len(masks)


def sparsity_table(
    model: nn.Module,
    names: Iterable[str],
    masks: Mapping[str, torch.Tensor] | None = None,
    mask_sparsity: bool = False,
) -> list[dict[str, Any]]:
    """Per-layer sparsity of ``model``'s weights ``names``: the one table every report is built from.

    Each row: ``name``, ``shape``, ``numel``, ``zeros`` (exact zeros in the weight) and
    ``sparsity`` (their fraction); with ``mask_sparsity``, also ``mask_sparsity`` (the masked
    fraction of each tensor in ``masks``: a pass over the mask, so not computed at every
    log). A sharded (FSDP2 or ZeRO-3) weight is not gathered (no collective in a report): its mask's
    zeros stand in for the weight's.
    """
    masks = masks or {}
    rows = []
    for name in names:
        p = model.get_parameter(name)
        mask = masks.get(name)
        if is_sharded(p):
            zeros = int((mask == 0).sum()) if mask is not None else 0
        else:
            zeros = int((p.detach() == 0).sum())
        n = full_numel(p)
        row = {
            "name": name,
            "shape": list(full_shape(p)),
            "numel": n,
            "zeros": zeros,
            "sparsity": zeros / max(n, 1),
        }
        if mask_sparsity and mask is not None:
            row["mask_sparsity"] = 1.0 - float(mask.sum(dtype=torch.int64)) / max(mask.numel(), 1)
        rows.append(row)
    return rows
