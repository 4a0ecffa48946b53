"""LoRA (``peft``) on sparse models: the engine's view of a ``PeftModel``, masked-mode adapters, merging.

* :mod:`~hf_sparsity.lora.view`: :class:`PeftBaseView`, the base model under its plain names.
* :mod:`~hf_sparsity.lora.masked`: ``lora: masked``, the update ``(B·A) ⊙ M`` as a peft ``LoraVariant``.

:func:`~hf_sparsity.export.merge.merge_sparse` (merging that keeps the masks exact) sits above the engine,
which imports this package: it lives in :mod:`hf_sparsity.export.merge`.

``peft`` is an optional dependency (``pip install hf_sparsity[peft]``): nothing here imports
it unless a ``PeftModel`` is given.
"""

from .masked import apply_masked_mode, masked_layers, remove_masked_mode
from .view import LORA_MODES, PeftBaseView, base_name, check_lora_mode, is_peft_model, peft_view

__all__ = [
    "LORA_MODES",
    "PeftBaseView",
    "apply_masked_mode",
    "base_name",
    "check_lora_mode",
    "is_peft_model",
    "masked_layers",
    "peft_view",
    "remove_masked_mode",
]
