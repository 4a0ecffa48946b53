"""Run a model's sparse layers through a :mod:`~hf_sparsity.backends` backend, and undo it.

::

    model = AutoModelForCausalLM.from_pretrained(ckpt)        # ckpt holds sparsity_masks.safetensors
    sparsify_for_inference(model, backend="csr")              # swaps targeted nn.Linear / Conv1D
    model.generate(**inputs)
    restore_dense(model)                                      # the original modules are back

Where masks come from (``masks=``):

* ``None`` (default): the ``sparsity_masks.safetensors`` of the folder the model was
  loaded from (``model.config._name_or_path``); an error when there is none.
* a folder or mask file path: read with :func:`hf_sparsity.serialization.load_masks`.
* a dict ``name -> mask`` (e.g. ``SparsityEngine.masks``).
* ``"zeros"``: the exact zeros of the targeted weights (the default projection / FFN
  rule, or ``config``). Only for finalized checkpoints, which carry no masks: inferring
  masks from ``weight == 0`` is fragile, so it is never done implicitly.

The mask wins over the weight: a masked position computes as 0 even if the weight
holds a value there.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn

from .backends import SparseBackend, get_backend
from .targeting import unwrap_model
from .utils import SparsityError

logger = logging.getLogger(__name__)


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D"  # transformers.pytorch_utils.Conv1D (GPT-2 family)


class SparseLinear(nn.Module):
    """Stands in for an ``nn.Linear`` or GPT-2 ``Conv1D``: ``y = backend.linear(x) + bias``.

    Keeps the original module (outside the module tree, so ``parameters()`` and
    ``state_dict()`` hold only the bias) for :func:`restore_dense`, unless built with
    ``keep_dense=False``, in which case the dense layer is rebuilt from the backend.
    """

    def __init__(self, original: nn.Module, backend: SparseBackend, keep_dense: bool = True):
        super().__init__()
        self.backend = backend
        self.in_features = backend.in_features
        self.out_features = backend.out_features
        self.was_conv1d = _is_conv1d(original)
        self.bias = original.bias
        self._original = [original if keep_dense else None]  # a list: not registered as a submodule
        self._orig_type = type(original)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.linear(x, self.bias)

    def to_dense_module(self) -> nn.Module:
        """The original module, or (without ``keep_dense``) a new one holding the masked dense weight."""
        orig = self._original[0]
        if orig is not None:
            return orig
        w = self.backend.to_dense()
        if self.was_conv1d:
            mod = self._orig_type(self.out_features, self.in_features)
            mod.weight = nn.Parameter(w.t().contiguous())
        else:
            mod = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
            mod.weight = nn.Parameter(w.contiguous())
        mod.bias = self.bias
        return mod.to(device=w.device)

    def extra_repr(self) -> str:
        kind = "Conv1D" if self.was_conv1d else "Linear"
        return f"{kind} -> {self.backend.name}: {self.backend.extra_repr()}"


def _resolve_masks(model: nn.Module, masks: Any, config: Any) -> dict[str, torch.Tensor]:
    from .constants import SPARSITY_MASKS_NAME
    from .serialization import load_masks

    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    if isinstance(masks, dict):
        return dict(masks)
    if isinstance(masks, str) and masks == "zeros":
        from .config import SparsityConfig
        from .targeting import plan_sparsity

        cfg = config if config is not None else SparsityConfig(sparsity=0.5)  # level unused: targets only
        names = [d.name for d in plan_sparsity(model, cfg) if d.sparsify]
        return {n: (model.get_parameter(n).detach() != 0).to(torch.uint8).cpu() for n in names}
    if masks is None:
        src = getattr(getattr(model, "config", None), "_name_or_path", None) or ""
        if src and os.path.isfile(os.path.join(src, SPARSITY_MASKS_NAME)):
            loaded, _ = load_masks(src, expected_shapes=shapes)
            return loaded
        raise SparsityError(
            f"No masks for sparsify_for_inference: the model's folder ({src or 'unknown'}) holds no "
            f"{SPARSITY_MASKS_NAME}. Pass masks=<folder or mask file>, masks=engine.masks, or, for a "
            'finalized checkpoint, masks="zeros" to use the exact zeros of the targeted weights.'
        )
    if isinstance(masks, (str, os.PathLike)):
        loaded, _ = load_masks(masks, expected_shapes=shapes)
        return loaded
    raise SparsityError(f"masks must be None, a path, a dict or 'zeros', not {type(masks).__name__}.")


def resolve_masks(model: nn.Module, masks: Any = None, config: Any = None) -> dict[str, torch.Tensor]:
    """The masks ``sparsify_for_inference(model, masks=masks, config=config)`` would use, by parameter name.

    ``masks`` as in the module docstring (``None``: the model folder's mask file; a path; a dict;
    ``"zeros"``). Raises :class:`~hf_sparsity.utils.SparsityError` when there are none or they do
    not match the model.
    """
    return _resolve_masks(unwrap_model(model), masks, config)


@torch.no_grad()
def sparsify_for_inference(
    model: nn.Module,
    backend: str | type[SparseBackend] = "csr",
    masks: Any = None,
    *,
    config: Any = None,
    keep_dense: bool = True,
    **backend_options: Any,
) -> nn.Module:
    """Swap every masked ``nn.Linear`` / ``Conv1D`` of ``model`` for a :class:`SparseLinear` on ``backend``.

    Args:
        model: a transformers model (DDP / accelerate wrappers are unwrapped).
        backend: a registered backend name (``csr``, ``masked_dense``, ``semi_structured``,
            ``emulator``) or class.
        masks: where the masks come from; see the module docstring (default: the
            model folder's ``sparsity_masks.safetensors``).
        config: a :class:`~hf_sparsity.SparsityConfig` choosing the targets for ``masks="zeros"``.
        keep_dense: keep the original modules so :func:`restore_dense` puts them back
            unchanged (default). ``False`` frees the dense weights; restoring then
            rebuilds them from the sparse ones (masked positions exactly 0).
        **backend_options: passed to the backend's ``from_dense`` (e.g. ``kernel="torch"``).

    Returns the same model, modified in place. ``model.generate`` works as before.
    """
    model_u = unwrap_model(model)
    klass = get_backend(backend)
    if any(isinstance(m, SparseLinear) for m in model_u.modules()):
        raise SparsityError("The model is already sparsified for inference; call restore_dense(model) first.")
    found = _resolve_masks(model_u, masks, config)
    swapped = 0
    for name, mask in found.items():
        module_name, _, attr = name.rpartition(".")
        owner = model_u.get_submodule(module_name) if module_name else model_u
        if attr != "weight" or not (isinstance(owner, nn.Linear) or _is_conv1d(owner)):
            raise SparsityError(
                f"Mask {name!r} is not the weight of an nn.Linear or Conv1D ({type(owner).__name__}); "
                "sparsify_for_inference only swaps linear layers."
            )
        weight = owner.weight
        mask = mask.to(weight.device)
        if _is_conv1d(owner):  # Conv1D stores [in, out]; backends take [out, in]
            w2, m2 = weight.t().contiguous(), mask.t().contiguous()
        else:
            w2, m2 = weight, mask
        prepared = klass.from_dense(w2.detach(), m2, **backend_options)
        parent_name, _, child = module_name.rpartition(".")
        parent = model_u.get_submodule(parent_name) if parent_name else model_u
        setattr(parent, child, SparseLinear(owner, prepared, keep_dense=keep_dense))
        swapped += 1
    logger.info("sparsify_for_inference: %d layers now run on %s.", swapped, klass.name)
    return model


def restore_dense(model: nn.Module) -> nn.Module:
    """Undo :func:`sparsify_for_inference`: put the dense modules back. Returns the model."""
    model_u = unwrap_model(model)
    for name, module in list(model_u.named_modules()):
        if isinstance(module, SparseLinear):
            parent_name, _, child = name.rpartition(".")
            parent = model_u.get_submodule(parent_name) if parent_name else model_u
            setattr(parent, child, module.to_dense_module())
    return model


def sparse_layers(model: nn.Module) -> dict[str, SparseLinear]:
    """The :class:`SparseLinear` modules of a sparsified model, by module name."""
    return {n: m for n, m in unwrap_model(model).named_modules() if isinstance(m, SparseLinear)}
