"""``EvalCallback``: run evaluation suites inside ``transformers.Trainer`` at its evaluation steps."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from transformers import TrainerCallback

from .report import flat_metrics
from .runner import evaluate, parse_suites

logger = logging.getLogger(__name__)


def metric_key(flat_key: str, prefix: str = "eval_") -> str:
    """``"pile/loss"`` -> ``"eval_pile_loss"``, the way Trainer names its evaluation metrics."""
    return prefix + flat_key.replace("/", "_")


class EvalCallback(TrainerCallback):
    """Run chosen suites (with a limit) whenever Trainer evaluates, and report them as ``eval_*`` metrics.

    On every ``on_evaluate`` (Trainer's ``eval_strategy`` steps, or an explicit
    ``trainer.evaluate()``), the model is scored on ``suites`` and the numbers are
    added, prefixed like Trainer's own (``eval_pile_loss``, ``eval_arc_easy_acc``,
    ``eval_harness7_average_acc``), to the metrics dict ``trainer.evaluate()`` returns,
    so ``metric_for_best_model`` can name them. They are logged through ``trainer.log``
    (TensorBoard, W&B, ``state.log_history``) when the callback is bound with
    :meth:`bind`; otherwise they are appended to ``state.log_history`` directly.

    Example::

        cb = EvalCallback("pile,lambada", data_dir="DATA_DIR", limit=50)
        trainer = Trainer(model=model, args=args, train_dataset=ds, eval_dataset=ev, callbacks=[cb])
        cb.bind(trainer)

    Only the main process evaluates (DDP); the suites run on the unwrapped model, in
    eval mode, and training mode is restored afterwards. Constructor arguments are
    JSON-simple.
    """

    def __init__(
        self,
        suites: str | Sequence[str] = "pile",
        *,
        data_dir: str | os.PathLike | None = None,
        pile_data: str | None = None,
        wikitext_file: str | None = None,
        limit: int | None = 100,
        batch_size: int = 4,
        context: int | None = None,
        stride: int | None = None,
        tokenizer: Any = None,
        prefix: str = "eval_",
    ):
        self.suites = parse_suites(suites)
        self.kwargs = dict(
            data_dir=data_dir,
            pile_data=pile_data,
            wikitext_file=wikitext_file,
            limit=limit,
            batch_size=batch_size,
            context=context,
            stride=stride,
        )
        self.tokenizer = tokenizer
        self.prefix = prefix
        self.trainer = None
        self.history: list[dict[str, Any]] = []

    def bind(self, trainer: Any) -> EvalCallback:
        """Log through ``trainer.log`` so reporters (TensorBoard, W&B) receive the metrics. Returns
        ``self``."""
        self.trainer = trainer
        return self

    def run(self, model: Any, tokenizer: Any) -> dict[str, float]:
        """Evaluate ``model`` now and return the prefixed metrics."""
        results = evaluate(model, self.suites, tokenizer=tokenizer, progress=False, **self.kwargs)
        return {metric_key(k, self.prefix): v for k, v in flat_metrics(results).items()}

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if not state.is_world_process_zero:
            return
        model = kwargs.get("model")
        tokenizer = self.tokenizer or kwargs.get("processing_class")
        if model is None or tokenizer is None:
            logger.warning(
                "EvalCallback: no model or tokenizer in the callback arguments; pass tokenizer=..."
            )
            return
        ours = self.run(model, tokenizer)
        if metrics is not None:
            metrics.update(ours)
        self.history.append({**ours, "step": state.global_step})
        if self.trainer is not None:
            self.trainer.log(dict(ours))
        else:
            state.log_history.append({**ours, "step": state.global_step})
            logger.info("step %d: %s", state.global_step, ours)
