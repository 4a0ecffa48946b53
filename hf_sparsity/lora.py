"""LoRA (``peft``) on sparse models, and merging that keeps the masks exact.

A ``PeftModel`` renames every wrapped weight: GPT-2's ``transformer.h.0.attn.c_attn.weight``
becomes ``base_model.model.transformer.h.0.attn.c_attn.base_layer.weight`` beside the new
``lora_A`` / ``lora_B`` weights. :class:`PeftBaseView` shows the engine the base model under
its plain names, so the default targeting rule, explicit patterns, mask files from a sparse
base folder and the mask file written from the ``PeftModel`` all use the base model's names.

Two modes, chosen with ``lora:`` in the sparsity config:

* ``masked``: the adapter's update is applied as ``(B·A) ⊙ M`` (``M`` the base weight's
  mask), in the forward pass and in peft's own merge. The merged weight is exactly as
  sparse as the base and the merged model computes what the adapter model computed. It
  costs one dense ``out x in`` update matrix per wrapped layer and step.
* ``merge_then_mask`` (also what an unset ``lora`` means): a plain adapter; :func:`merge_sparse`
  re-applies the mask after merging, which drops the part of ``B·A`` at masked positions.

``peft`` is an optional dependency (``pip install hf_sparsity[peft]``): nothing here
imports it unless a ``PeftModel`` is given.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .checks import LORA_MODES, check_lora_mode
from .hooks import drop_lora_variant, set_lora_variant
from .utils import SparsityError

logger = logging.getLogger(__name__)

# Path segments peft inserts around a wrapped module (collapsed) and adapter-owned ones (hidden).
_WRAPPER_PARTS = ("base_layer", "original_module")
_ADAPTER_PREFIXES = ("lora_", "modules_to_save")


def is_peft_model(model: Any) -> bool:
    return hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None))


def base_name(name: str) -> str | None:
    """The plain model's name for a parameter of a peft-wrapped model; None for adapter parameters."""
    parts = name.split(".")
    if any(p.startswith(_ADAPTER_PREFIXES) for p in parts):
        return None
    return ".".join(p for p in parts if p not in _WRAPPER_PARTS)


class PeftBaseView:
    """The base model inside a ``PeftModel``, under the plain model's parameter and module names.

    It answers what :class:`~hf_sparsity.engine.SparsityEngine` and the targeting rules ask
    of a model (``named_parameters``, ``get_parameter``, ``named_modules``, the embeddings,
    ``config``); the tensors are the ``PeftModel``'s own, so masking them masks the model.
    """

    def __init__(self, peft_model: nn.Module):
        self.peft_model = peft_model
        self.base = peft_model.get_base_model()
        self._real: dict[str, str] = {}
        for name, _ in self.base.named_parameters():
            plain = base_name(name)
            if plain is None:
                continue
            if plain in self._real:
                raise SparsityError(
                    f"Parameters {self._real[plain]!r} and {name!r} of the peft model both map to {plain!r}; "
                    "hf_sparsity cannot tell which is the base weight."
                )
            self._real[plain] = name

    @property
    def config(self):
        return self.base.config

    def real_name(self, name: str) -> str:
        """The parameter's name inside the peft-wrapped base model (``...base_layer.weight``)."""
        try:
            return self._real[name]
        except KeyError:
            raise AttributeError(f"{type(self.base).__name__} has no parameter {name!r}") from None

    def get_parameter(self, name: str) -> nn.Parameter:
        return self.base.get_parameter(self.real_name(name))

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for plain, real in self._real.items():
            yield plain, self.base.get_parameter(real)

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def named_modules(self) -> Iterator[tuple[str, nn.Module]]:
        for name, mod in self.base.named_modules():
            parts = name.split(".")
            if any(p.startswith(_ADAPTER_PREFIXES) for p in parts) or hasattr(mod, "base_layer"):
                continue  # adapter modules, and the wrappers (their base_layer stands for them)
            yield ".".join(p for p in parts if p not in _WRAPPER_PARTS), mod

    def modules(self) -> Iterator[nn.Module]:
        for _, m in self.named_modules():
            yield m

    def get_input_embeddings(self):
        return self.base.get_input_embeddings()

    def get_output_embeddings(self):
        return self.base.get_output_embeddings()

    def lora_layers(self) -> Iterator[tuple[str, nn.Module]]:
        """(plain weight name, peft wrapper) for every module peft wrapped with an adapter."""
        for name, mod in self.base.named_modules():
            if hasattr(mod, "base_layer") and hasattr(mod, "lora_A"):
                plain = base_name(name)
                if plain is not None:
                    yield f"{plain}.weight", mod

    # -------------------------------------------------------------- engine hook
    def masks_changed(self, engine) -> None:
        """Called by the engine whenever its masks change: (re)install masked mode if the config asks."""
        self.peft_model._hf_sparsity = {"masks": engine.masks, "config": engine.config, "engine": engine}
        if getattr(engine.config, "lora", None) == "masked":
            apply_masked_mode(self, engine.masks)


def peft_view(model: Any) -> Any:
    """``model`` itself, or a :class:`PeftBaseView` of it when it is a ``PeftModel``."""
    return PeftBaseView(model) if is_peft_model(model) else model


# ---------------------------------------------------------------------- masked mode
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
            return delta * self.mask.to(delta.device, delta.dtype)

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


def apply_masked_mode(view: PeftBaseView, masks: Mapping[str, torch.Tensor]) -> list[str]:
    """Make every adapter on a masked weight apply ``(B·A) ⊙ M`` (forward and merge). Returns those names.

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
        variant = masked_variant_class()(masks[name].to(weight.device, weight.dtype))
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


__all__ = ["LORA_MODES", "PeftBaseView", "apply_masked_mode", "check_lora_mode", "peft_view"]
