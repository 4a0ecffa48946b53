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

import logging
import weakref
from collections.abc import Iterator
from typing import Any

from torch import nn

from ..checks import LORA_MODES, check_lora_mode
from ..utils import SparsityError
from .masked import apply_masked_mode

logger = logging.getLogger(__name__)

# Path segments peft inserts around a wrapped module (collapsed) and adapter-owned ones (hidden).
_ENGINE_STATE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""``PeftModel`` -> (its engine's mask state, its sparsity config), kept here rather than on the peft model;
neither holds the model, so an entry goes with its model."""

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

    It answers what :class:`~hf_sparsity.mask_engine.engine.SparsityEngine` and the targeting rules ask
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
        _ENGINE_STATE[self.peft_model] = (engine.state_, engine.config)
        if getattr(engine.config, "lora", None) == "masked":
            apply_masked_mode(self, engine.masks)


def engine_state(peft_model: nn.Module) -> tuple[Any, Any] | None:
    """``(MaskState, SparsityConfig)`` of the last engine whose masks changed on ``peft_model`` (its masks,
    step count and events as they are now), or ``None``: what ``merge_sparse`` merges with."""
    return _ENGINE_STATE.get(peft_model)


def peft_view(model: Any) -> Any:
    """``model`` itself, or a :class:`PeftBaseView` of it when it is a ``PeftModel``."""
    return PeftBaseView(model) if is_peft_model(model) else model


__all__ = [
    "LORA_MODES",
    "PeftBaseView",
    "base_name",
    "check_lora_mode",
    "engine_state",
    "is_peft_model",
    "peft_view",
]
