"""Per-layer and per-model FLOP figures (:class:`LayerFlops`, :class:`FlopReport`)."""

from __future__ import annotations

import logging
import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any

TRAINING_MULTIPLIER = 3
"""Forward + backward = 3x forward (the backward pass computes input and weight gradients)."""

logger = logging.getLogger("hf_sparsity.flops")
_BLOCK_INDEX_RE = re.compile(r"\.\d+\.")


@dataclass
class LayerFlops:
    """One term of the FLOP count: a linear layer, one block's attention, the logits, or an embedding.

    ``dense_flops_per_token`` is the forward cost at density 1; for attention it is the
    coefficient per token of sequence length (multiply by ``seq_len``), since attention
    per token grows with the context.
    """

    name: str
    kind: str  # linear | attention | logits | embedding
    shape: tuple[int, ...] = ()
    params: int = 0
    nonzero_params: int = 0
    sparsity: float = 0.0
    dense_flops_per_token: float = 0.0

    def forward_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token of this term at its sparsity."""
        if self.kind == "attention":
            return self.dense_flops_per_token * seq_len
        if self.kind == "embedding":
            return 0.0  # excluded, as in Cerebras' sparse GPT FLOP counts
        return self.dense_flops_per_token * (1.0 - self.sparsity)

    def dense_forward_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token of this term if it were dense."""
        if self.kind in ("attention", "embedding"):
            return self.forward_flops_per_token(seq_len)
        return self.dense_flops_per_token

    @property
    def group(self) -> str:
        """The name with the block index replaced by ``*``: identical layers of every block share it."""
        return _BLOCK_INDEX_RE.sub(".*.", self.name)


@dataclass
class FlopReport:
    """FLOPs and parameters of one model at one set of per-layer sparsity levels.

    ``params`` counts every unique parameter (tied weights once, embeddings and
    biases included); ``nonzero_params`` subtracts the masked weights.
    """

    layers: list[LayerFlops]
    seq_len: int
    params: int
    nonzero_params: int
    model_type: str = ""
    notes: list[str] = field(default_factory=list)

    # -------------------------------------------------------------- totals
    @property
    def forward_flops_per_token(self) -> float:
        return sum(t.forward_flops_per_token(self.seq_len) for t in self.layers)

    @property
    def inference_flops_per_token(self) -> float:
        """Forward FLOPs per token, averaged over a full sequence of ``seq_len`` (Chinchilla's convention)."""
        return self.forward_flops_per_token

    @property
    def training_flops_per_token(self) -> float:
        return TRAINING_MULTIPLIER * self.forward_flops_per_token

    @property
    def forward_flops_per_sequence(self) -> float:
        return self.forward_flops_per_token * self.seq_len

    @property
    def training_flops_per_sequence(self) -> float:
        return self.training_flops_per_token * self.seq_len

    @property
    def embedding_flops_per_token(self) -> float:
        """Chinchilla's embedding term (2 * V * d per token): reported, never added to the totals."""
        return sum(t.dense_flops_per_token for t in self.layers if t.kind == "embedding")

    def kind_flops_per_token(self, kind: str) -> float:
        return sum(t.forward_flops_per_token(self.seq_len) for t in self.layers if t.kind == kind)

    # -------------------------------------------------------------- variants
    def dense(self) -> FlopReport:
        """The same model with every layer dense."""
        layers = [replace(t, sparsity=0.0, nonzero_params=t.params) for t in self.layers]
        return FlopReport(layers, self.seq_len, self.params, self.params, self.model_type, list(self.notes))

    def with_seq_len(self, seq_len: int) -> FlopReport:
        return replace(self, seq_len=int(seq_len))

    @property
    def sparsity_levels(self) -> dict[str, float]:
        """Per-layer level of every sparse term (name -> sparsity)."""
        return {t.name: t.sparsity for t in self.layers if t.sparsity > 0}

    # -------------------------------------------------------------- output
    def summary(self) -> dict[str, Any]:
        """The headline numbers, as ``hf_sparsity flops --json`` prints them."""
        return {
            "params": int(self.params),
            "nonzero_params": int(self.nonzero_params),
            "inference_flops_per_token": self.inference_flops_per_token,
            "training_flops_per_token": self.training_flops_per_token,
            "inference_flops_per_sequence": self.forward_flops_per_sequence,
            "training_flops_per_sequence": self.training_flops_per_sequence,
            "seq_len": int(self.seq_len),
        }

    def to_dict(self) -> dict[str, Any]:
        d = self.summary()
        d["model_type"] = self.model_type
        d["layers"] = [dict(asdict(t), shape=list(t.shape)) for t in self.layers]
        return d

    def grouped(self) -> list[dict[str, Any]]:
        """Rows per layer group (block index folded): count, params, forward FLOPs per token."""
        rows: dict[str, dict[str, Any]] = {}
        for t in self.layers:
            r = rows.setdefault(
                t.group,
                {"group": t.group, "kind": t.kind, "shape": t.shape, "count": 0, "params": 0,
                 "nonzero_params": 0, "flops_per_token": 0.0, "levels": set()},
            )  # fmt: skip
            r["count"] += 1
            r["params"] += t.params
            r["nonzero_params"] += t.nonzero_params
            r["flops_per_token"] += t.forward_flops_per_token(self.seq_len)
            r["levels"].add(round(t.sparsity, 4))
        for r in rows.values():
            levels = sorted(r.pop("levels"))
            r["sparsity"] = levels[0] if len(levels) == 1 else (levels[0], levels[-1])
        return list(rows.values())
