"""``lora: masked``: the adapter's update is ``(B·A) ⊙ M`` in the forward pass and in peft's merge.

Done through peft's own ``LoraVariant`` interface: one :class:`MaskedLoraVariant` per wrapped
layer that covers a sparse weight, attached with :func:`hf_sparsity.hooks.set_lora_variant`.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..hooks import drop_lora_variant, set_lora_variant
from ..utils import SparsityError

logger = logging.getLogger(__name__)


def _check_maskable(name: str, layer: nn.Module) -> None:
    from peft.tuners.lora.layer import Linear as LoraLinear

    base = layer.base_layer
    if type(layer) is not LoraLinear or type(base).__name__ not in ("Linear", "Conv1D"):
        raise SparsityError(
            f"`lora: masked` cannot mask the adapter on {name!r}: peft wraps this {type(base).__name__} as "
            f"{type(layer).__module__}.{type(layer).__name__}, whose update is not a (B·A) matrix in the "
            "weight's layout. Leave it out of the adapter's target_modules, or use `lora: merge_then_mask`."
        )
    variants = [a for a, v in getattr(layer, "lora_variant", {}).items() if not _is_masked_variant(v)]
    if variants or any(getattr(layer, "use_dora", {}).values()):
        raise SparsityError(
            f"`lora: masked` on {name!r}: the adapter uses a LoRA variant (DoRA or similar, adapters "
            f"{variants or list(layer.use_dora)}), whose merged weight is not W + B·A. Use plain LoRA or "
            "`lora: merge_then_mask`."
        )
    if any(getattr(layer, "lora_bias", {}).values()):
        raise SparsityError(
            f"`lora: masked` on {name!r}: the adapter trains a bias (lora_bias=True); masked mode masks "
            "weights only. Set lora_bias=False."
        )


@functools.cache
def masked_variant_class() -> type:
    """``MaskedLoraVariant``, a subclass of peft's ``LoraVariant``, built on first use (peft is optional)."""
    from peft.tuners.lora.layer import LoraVariant

    class MaskedLoraVariant(LoraVariant):
        """Plain LoRA whose update is ``(B·A) ⊙ M``, ``M`` the base weight's mask, in forward and merge.

        One instance per wrapped layer holds that layer's mask; peft's ``Linear`` calls it for
        every adapter it is attached to (:func:`hf_sparsity.hooks.set_lora_variant`). peft has
        already cast the input to the adapter's dtype before :meth:`forward`.
        """

        def __init__(self, mask: torch.Tensor):
            self.mask = mask

        def supports_lora_conversion(self) -> bool:
            return False  # the masked update is not a rank-r B·A

        @staticmethod
        def init(module: nn.Module, adapter_name: str, **kwargs: Any) -> None:
            pass  # nothing to build: the mask is given

        def delta(self, module: nn.Module, adapter: str) -> torch.Tensor:
            """peft's ``B·A·scaling`` in the base weight's layout, masked."""
            delta = module.get_delta_weight(adapter)
            if self.mask.device != delta.device:  # the model moved since: follow it once, not every forward
                self.mask = self.mask.to(delta.device)
            return delta * self.mask  # the uint8 mask promotes to delta's dtype: no cast copy

        def merge_safe(self, module: nn.Module, active_adapter: str, orig_weight: torch.Tensor):
            return orig_weight + self.delta(module, active_adapter).to(orig_weight.dtype)

        def merge_unsafe(self, module: nn.Module, active_adapter: str, orig_weight: torch.Tensor) -> None:
            orig_weight.data += self.delta(module, active_adapter).to(orig_weight.dtype)

        def unmerge(self, module: nn.Module, active_adapter: str, orig_weight: torch.Tensor) -> torch.Tensor:
            return orig_weight.data - self.delta(module, active_adapter).to(orig_weight.dtype)

        def forward(
            self, module: nn.Module, active_adapter: str, x: torch.Tensor, result: torch.Tensor, **kwargs: Any
        ) -> torch.Tensor:
            delta = self.delta(module, active_adapter)
            weight = delta.t() if module.fan_in_fan_out else delta  # -> (out, in), as F.linear wants
            return result + F.linear(module.lora_dropout[active_adapter](x), weight)

    return MaskedLoraVariant


def _is_masked_variant(variant: Any) -> bool:
    return "peft" in sys.modules and isinstance(variant, masked_variant_class())


def apply_masked_mode(view: Any, masks: Mapping[str, torch.Tensor]) -> list[str]:
    """Make every adapter on a masked weight apply ``(B·A) ⊙ M`` (forward and merge). Returns those names.

    ``view``: the :class:`~hf_sparsity.lora.view.PeftBaseView` of the model (its ``lora_layers()``).

    Checks everything before changing anything: an adapter covering no masked weight, or
    a masked weight wrapped by a layer type whose update is not ``B·A``, is an error.
    """
    layers = list(view.lora_layers())
    covered = [(n, layer) for n, layer in layers if n in masks]
    if not covered:
        wrapped = sorted({n.rsplit(".", 2)[-2] for n, _ in layers}) or ["none"]
        raise SparsityError(
            f"`lora: masked`: the adapter's target modules ({', '.join(wrapped)}) cover no sparse weight, so "
            "there is nothing to keep masked. Add the sparse projections to LoraConfig(target_modules=...) "
            "(e.g. the attention and MLP projections), or drop `lora: masked`."
        )
    for name, layer in covered:
        _check_maskable(name, layer)
    for name, layer in covered:
        weight = layer.base_layer.weight
        variant = masked_variant_class()(masks[name].to(weight.device))  # uint8, beside its weight
        for adapter in layer.lora_A:
            set_lora_variant(layer, adapter, variant)
    logger.info("lora: masked: %d adapter layers apply (B·A) ⊙ M.", len(covered))
    return [n for n, _ in covered]


def remove_masked_mode(peft_model: nn.Module) -> None:
    """Make every adapter in masked mode plain LoRA again (peft's own forward and merge)."""
    for mod in peft_model.modules():
        for adapter, variant in list(getattr(mod, "lora_variant", {}).items()):
            if _is_masked_variant(variant):
                drop_lora_variant(mod, adapter)


def masked_layers(peft_model: nn.Module) -> list[nn.Module]:
    """The peft layers whose adapters are in masked mode."""
    return [
        m
        for m in peft_model.modules()
        if any(_is_masked_variant(v) for v in getattr(m, "lora_variant", {}).values())
    ]


__all__ = ["apply_masked_mode", "masked_layers", "masked_variant_class", "remove_masked_mode"]
