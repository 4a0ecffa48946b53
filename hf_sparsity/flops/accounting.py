"""Training-time accounting: cumulative FLOPs at the levels in force (:class:`FlopAccountant`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn

from ..utils import SparsityError
from .counting import (
    count_flops,
)
from .report import TRAINING_MULTIPLIER, FlopReport, logger


class FlopAccountant:
    """Cumulative training FLOPs of a run whose sparsity changes, and the dense-equivalent FLOPs.

    Trainer-independent; the sparsity callback (or any loop) calls it once per
    optimizer step, or per logging interval, with the tokens processed and the
    current per-tensor levels::

        acc = FlopAccountant(model, targets=engine.targets, seq_len=block_size)
        ...
        acc.add_tokens(n_tokens, engine.levels)   # levels: name -> sparsity; absent names count dense
        logs.update(acc.log_dict())               # flops/train, flops/dense_equivalent, ...
        state = acc.state_dict(); acc.load_state_dict(state)   # carry across resume

    After a densify event pass ``{}`` (or the levels left): every tensor not named is
    dense. Reported:

    * ``training_flops``: 3x forward FLOPs actually needed at the levels in force;
    * ``dense_training_flops``: the same tokens trained fully dense;
    * ``effective_sparsity``: the FLOP-weighted average level of the sparsifiable
      layers, ``1 - spent / dense`` over those layers only. This is the "effective
      75%" of Variable SPDF (Gupta et al. 2023, after SPDF, arXiv:2303.10464): 90% sparse for 5/6
      of the tokens and dense for the rest gives 0.75;
    * ``flop_reduction``: ``dense_training_flops / training_flops`` for the whole model
      (attention and logits included, so it stays below ``1 / (1 - effective)``).

    ``targets`` names the sparsifiable tensors (default: every tensor ever given a
    level); their dense FLOPs form the denominator of ``effective_sparsity``.
    """

    def __init__(
        self,
        model: nn.Module | FlopReport,
        *,
        targets: Iterable[str] | None = None,
        seq_len: int | None = None,
    ):
        report = model if isinstance(model, FlopReport) else count_flops(model, seq_len=seq_len)
        if seq_len is not None:
            report = report.with_seq_len(seq_len)
        self.seq_len = report.seq_len
        self._linear: dict[str, float] = {}  # name -> dense forward FLOPs per token
        self._fixed = 0.0  # forward FLOPs per token that sparsity never changes (attention, logits)
        for t in report.layers:
            if t.kind == "linear":
                self._linear[t.name] = self._linear.get(t.name, 0.0) + t.dense_flops_per_token
            elif t.kind in ("attention", "logits"):
                self._fixed += t.dense_forward_flops_per_token(self.seq_len)
            # embeddings: excluded from FLOPs, as in Cerebras' sparse GPT FLOP counts
        self._dense_forward = self._fixed + sum(self._linear.values())
        self._ignored: set[str] = set()
        self.targets: set[str] = self._known(targets or ())
        self.tokens = 0
        self.training_flops = 0.0
        self.dense_training_flops = 0.0
        self.target_flops = 0.0  # spent in the sparsifiable layers
        self.dense_target_flops = 0.0

    def forward_flops_per_token(self, levels: Mapping[str, float] | None = None) -> float:
        """Forward FLOPs per token at ``levels`` (name -> sparsity; absent names dense)."""
        levels = levels or {}
        known = self._known(levels)
        return self._dense_forward - sum(self._linear[n] * float(levels[n]) for n in known)

    def _known(self, names: Iterable[str]) -> set[str]:
        """The names that are linear layers; others (a sparse embedding, say) have no counted FLOPs.

        Called on every step by a training loop, so unknown names warn once instead of raising.
        """
        names = set(names)
        unknown = names - set(self._linear) - self._ignored
        if unknown:
            logger.warning(
                "FLOP accounting ignores sparsity of %d tensor(s) that are not linear layers (e.g. %s): "
                "their FLOPs are not counted (embeddings) or not adjustable.",
                len(unknown),
                sorted(unknown)[0],
            )
            self._ignored |= unknown
        return names & set(self._linear)

    def add_tokens(self, n_tokens: int, levels: Mapping[str, float] | None = None) -> float:
        """Account ``n_tokens`` trained at ``levels``; returns the training FLOPs they cost."""
        if n_tokens < 0:
            raise SparsityError(f"n_tokens must be >= 0, got {n_tokens}.")
        levels = dict(levels or {})
        self.targets.update(self._known(levels))
        fwd = self.forward_flops_per_token(levels)
        spent = TRAINING_MULTIPLIER * fwd * n_tokens
        self.tokens += int(n_tokens)
        self.training_flops += spent
        self.dense_training_flops += TRAINING_MULTIPLIER * self._dense_forward * n_tokens
        tgt_dense = sum(self._linear[n] for n in self.targets)
        tgt_spent = sum(self._linear[n] * (1.0 - float(levels.get(n, 0.0))) for n in self.targets)
        self.dense_target_flops += TRAINING_MULTIPLIER * tgt_dense * n_tokens
        self.target_flops += TRAINING_MULTIPLIER * tgt_spent * n_tokens
        return spent

    @property
    def effective_sparsity(self) -> float:
        if self.dense_target_flops <= 0:
            return 0.0
        return 1.0 - self.target_flops / self.dense_target_flops

    @property
    def flop_reduction(self) -> float:
        return self.dense_training_flops / self.training_flops if self.training_flops else 1.0

    @property
    def flop_savings(self) -> float:
        """Fraction of the dense-equivalent training FLOPs not spent (whole model)."""
        return 1.0 - self.training_flops / self.dense_training_flops if self.dense_training_flops else 0.0

    def log_dict(self, prefix: str = "sparsity/") -> dict[str, float]:
        """Scalars for a logger (TensorBoard, ``Trainer.log``)."""
        return {
            f"{prefix}train_flops": self.training_flops,
            f"{prefix}dense_equivalent_flops": self.dense_training_flops,
            f"{prefix}effective_sparsity": self.effective_sparsity,
            f"{prefix}flop_reduction": self.flop_reduction,
            f"{prefix}tokens": float(self.tokens),
        }

    def state_dict(self) -> dict[str, Any]:
        """JSON-simple state, to carry in a checkpoint."""
        return {
            "tokens": self.tokens,
            "training_flops": self.training_flops,
            "dense_training_flops": self.dense_training_flops,
            "target_flops": self.target_flops,
            "dense_target_flops": self.dense_target_flops,
            "targets": sorted(self.targets),
            "seq_len": self.seq_len,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.tokens = int(state.get("tokens", 0))
        for key in ("training_flops", "dense_training_flops", "target_flops", "dense_target_flops"):
            setattr(self, key, float(state.get(key, 0.0)))
        self.targets.update(n for n in state.get("targets", ()) if n in self._linear)
