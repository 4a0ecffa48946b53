"""One-shot pruning of pretrained models: magnitude, Wanda and SparseGPT, unstructured and N:M,
with an exact least-squares refit of the kept weights (``refit=True``), block reconstruction
(``reconstruct_steps=N``), given masks (``masks=``), per-layer levels for a decoding speed target
(``speed=SpeedTarget(S)``, :mod:`~.spdy`), and block-by-block streaming of a model
folder (``prune_folder``, what ``hf_sparsity prune`` runs).

from hf_sparsity.pruning import prune_oneshot, read_documents, sample_calibration
calib = sample_calibration(read_documents("corpus.jsonl"), tokenizer, nsamples=128, seqlen=2048)
result = prune_oneshot(model, SparsityConfig(sparsity=0.5), calib, method="sparsegpt")
save_pruned(model, result, "out/", tokenizer=tokenizer)
fast = prune_oneshot(model, SparsityConfig(sparsity=0.5), calib, "sparsegpt", speed=SpeedTarget(1.5))
"""

from .calibration import read_documents, sample_calibration
from .levels import OWLSettings
from .methods import METHODS
from .oneshot import OneShotResult, prune_oneshot
from .save import save_pruned
from .spdy import SpeedTarget

__all__ = [
    "METHODS",
    "OWLSettings",
    "OneShotResult",
    "prune_oneshot",
    "read_documents",
    "sample_calibration",
    "save_pruned",
    "SpeedTarget",
]
