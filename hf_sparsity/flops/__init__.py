"""FLOPs and parameter accounting for dense and sparse causal LMs.

FLOPs follow Chinchilla (Hoffmann et al. 2022, arXiv:2203.15556) Appendix F, as Cerebras' sparse
GPT results do ("Creating Sparse GPT-3 Models with Iterative Pruning", 2022, footnote 1): embedding
FLOPs excluded, attention logits, softmax and the attention-weighted reduction included, final
logits included, biases, norms and non-linearities ignored; the backward pass costs twice the forward pass, so
training is 3x forward. Each linear layer is scaled by its own density
(``1 - sparsity``): a sparse GEMM is one multiply-add per nonzero weight, and the
backward pass (input and weight gradients) skips the same positions.

Per token, for a sequence of length ``L``:

* a linear layer ``d_in -> d_out`` at sparsity ``s``: ``2 * d_in * d_out * (1 - s)``;
* attention with ``h`` heads of size ``k``: ``2*L*h*k`` (logits) + ``3*h*L``
  (softmax) + ``2*L*h*k`` (reduction);
* final logits ``d -> V``: ``2 * d * V`` (dense unless explicitly targeted).

Everything is counted from the model's actual modules, so any architecture
counts right (GPT-2 Conv1D, Llama's three MLP matrices, GQA, a Sparse-IFT
model): every ``nn.Linear`` / ``Conv1D`` contributes its own shape, and a module
with weights in another form declares its matmuls through
``hf_sparsity_matmuls()`` (see :class:`hf_sparsity.ift.DopedLinear`). A
config-only path (:func:`count_flops_from_config`) builds the model on the
``meta`` device, which allocates nothing, so a 70B config counts in a second.

Typical use::

    report = count_flops(model, masks=engine.masks, seq_len=2048)
    report.inference_flops_per_token, report.nonzero_params
    count_flops_from_config("gpt3-xl/config.json", sparsity=0.838).summary()

and during training, :class:`FlopAccountant`.

Modules, one job each: :mod:`.report` (the figures), :mod:`.counting` (a model's
modules -> figures), :mod:`.configs` (config-only, on the ``meta`` device),
:mod:`.chinchilla` (the closed formula) and :mod:`.accounting` (cumulative training FLOPs).
"""

from .accounting import FlopAccountant
from .chinchilla import chinchilla_forward_flops
from .configs import build_meta_model, count_flops_from_config, load_config, mask_levels_from_file
from .counting import attention_flops_coefficient, count_flops
from .report import TRAINING_MULTIPLIER, FlopReport, LayerFlops

__all__ = [
    "TRAINING_MULTIPLIER",
    "FlopAccountant",
    "FlopReport",
    "LayerFlops",
    "attention_flops_coefficient",
    "build_meta_model",
    "chinchilla_forward_flops",
    "count_flops",
    "count_flops_from_config",
    "load_config",
    "mask_levels_from_file",
]
