"""Where ``SparsityCallback``'s metrics go: totals to the console, per-layer values to the reporters.

``SparsityCallback`` (and ``FlopCallback``) add their scalars to the ``logs`` dict of
``Trainer.log``: the measured total sparsity (``sparsity/total``), the FLOP counts
(``sparsity/train_flops``, ...) and one ``sparsity/layer/<name>`` entry per sparsified tensor
(210 for SmolLM2-135M). Every callback's ``on_log`` sees that same dict, in the order Trainer
lists its callbacks: its own first (``DefaultFlowCallback``, then the reporters that
``report_to`` names: ``TensorBoardCallback``, wandb, ...), then the ``callbacks=[...]`` given to
``Trainer``, then the console printer (``ProgressCallback``, or ``PrinterCallback`` with
``disable_tqdm=True``), which prints the whole dict. So, as Trainer builds the list:

* the reporters run before the sparsity callback and get none of its scalars;
* the console line gets the totals and FLOP counts; the per-layer values are left out
  (they would reach no reporter, and 210 of them would flood the line).

Nothing here changes that list on its own. One explicit call, after building the Trainer
and before ``trainer.train()``, does, through Trainer's public ``pop_callback`` /
``add_callback``::

    trainer = Trainer(..., callbacks=[sparsity_cb])
    arrange_logging(trainer, sparsity_cb)                       # reporters get every scalar
    arrange_logging(trainer, sparsity_cb, console_layers=True)  # ... and the console line too

It lists ``sparsity_cb`` first (the other callbacks keep their order after it, the console
printer last) and replaces a plain ``ProgressCallback`` / ``PrinterCallback`` by
:class:`SparsityProgressCallback` / :class:`SparsityPrinterCallback`, which print the logs
without the per-layer entries (the dict itself is untouched: every callback sees them). From
then on ``sparsity_cb`` also logs the per-layer values.

Switches: ``SparsityCallback(log_layers=False)`` logs no per-layer values anywhere (totals
and FLOPs only); ``TrainingArguments(report_to="none")`` turns the reporters off;
``SparsityCallback(print_report=True)`` prints the per-layer table at the end of training
(it is always logged at INFO level).
"""

from __future__ import annotations

from typing import Any
from weakref import WeakKeyDictionary

from transformers import PrinterCallback, ProgressCallback

from .utils import SparsityError

LAYER_PREFIX = "sparsity/layer/"
"""Prefix of the per-layer sparsity scalars."""

_ARRANGED: WeakKeyDictionary = WeakKeyDictionary()  # callback -> True once arrange_logging listed it first


def split_metrics(logs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(console, per_layer)``: the per-layer sparsity entries apart from everything else, order kept."""
    console = {k: v for k, v in logs.items() if not k.startswith(LAYER_PREFIX)}
    layers = {k: v for k, v in logs.items() if k.startswith(LAYER_PREFIX)}
    return console, layers


class _ConsoleFilter:
    """Mixin for Trainer's console printers: print the logs without the per-layer entries."""

    def __init__(self, *args, show_layers: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.show_layers = show_layers

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and not self.show_layers:
            logs = split_metrics(logs)[0]  # a copy: callbacks after this one still see every entry
        return super().on_log(args, state, control, logs=logs, **kwargs)


class SparsityProgressCallback(_ConsoleFilter, ProgressCallback):
    """``ProgressCallback`` (tqdm bar + log lines) that prints no ``sparsity/layer/*`` entries."""


class SparsityPrinterCallback(_ConsoleFilter, PrinterCallback):
    """``PrinterCallback`` (``disable_tqdm=True``) that prints no ``sparsity/layer/*`` entries."""


_CONSOLE = {
    ProgressCallback: SparsityProgressCallback,
    PrinterCallback: SparsityPrinterCallback,
    SparsityProgressCallback: SparsityProgressCallback,
    SparsityPrinterCallback: SparsityPrinterCallback,
}


def _console_printer(old: Any, console_layers: bool) -> Any:
    """The filtered printer that stands for ``old`` (a new one: ``arrange_logging`` runs before train)."""
    kind = _CONSOLE[type(old)]
    if issubclass(kind, ProgressCallback):
        return kind(show_layers=console_layers, max_str_len=getattr(old, "max_str_len", 100))
    return kind(show_layers=console_layers)


def arrange_logging(trainer: Any, callback: Any, console_layers: bool = False) -> None:
    """List ``callback`` first among ``trainer``'s callbacks and keep per-layer values off the console.

    Call it after building the Trainer and before ``trainer.train()``: the reporters then get
    every scalar ``callback`` adds to a log, and Trainer's console printer (a plain
    ``ProgressCallback`` / ``PrinterCallback``, replaced by its filtering subclass, still last)
    prints the per-layer ``sparsity/layer/*`` entries only with ``console_layers=True``. A
    printer of another class (a recipe's own) is left where it is. Only Trainer's public
    ``pop_callback`` / ``add_callback`` are used; calling it again changes ``console_layers``.
    """
    listed = list(trainer.callback_handler.callbacks)
    if not any(cb is callback for cb in listed):
        raise SparsityError(
            f"arrange_logging: {type(callback).__name__} is not one of this Trainer's callbacks; "
            "pass it in Trainer(..., callbacks=[...]) first, then call arrange_logging(trainer, callback)."
        )
    printers = [cb for cb in listed if type(cb) in _CONSOLE]
    others = [cb for cb in listed if cb is not callback and type(cb) not in _CONSOLE]
    for cb in listed:
        trainer.pop_callback(cb)
    for cb in (callback, *others):
        trainer.add_callback(cb)
    for cb in printers:
        trainer.add_callback(_console_printer(cb, console_layers))
    _ARRANGED[callback] = True


def logging_arranged(callback: Any) -> bool:
    """Whether :func:`arrange_logging` listed ``callback`` ahead of the reporters (it then logs per-layer)."""
    return _ARRANGED.get(callback, False)
