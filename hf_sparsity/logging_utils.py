"""Where ``SparsityCallback``'s metrics go: totals to the console, per-layer values to the reporters.

``SparsityCallback`` adds its scalars to the ``logs`` dict of ``Trainer.log``: the measured
total sparsity (``sparsity/total``), the FLOP counts (``sparsity/train_flops``, ...) and,
with ``log_layers=True``, one ``sparsity/layer/<name>`` entry per sparsified tensor (210 for
SmolLM2-135M). Every callback's ``on_log`` sees that same dict, in the order of
``trainer.callback_handler.callbacks``:

* reporters (``TensorBoardCallback``, wandb, ...) log every scalar they find, so they get
  the per-layer curves only if the sparsity callback ran *before* them;
* the console printer (``ProgressCallback``, or ``PrinterCallback`` with
  ``disable_tqdm=True``), which Trainer always adds last, prints the whole dict.

:func:`arrange_logging` puts the sparsity callback first and swaps the console printer for
a subclass that leaves the per-layer entries out of the printed line (the dict itself is
untouched, so later callbacks still see them). ``SparsityCallback`` calls it at train
begin; call it yourself to change the defaults::

    arrange_logging(trainer, sparsity_cb, console_layers=True)   # per-layer values on the console too

Switches: ``SparsityCallback(log_layers=False)`` logs no per-layer values anywhere (totals
and FLOPs only); ``TrainingArguments(report_to="none")`` turns the reporters off;
``SparsityCallback(print_report=True)`` prints the per-layer table at the end of training
(it is always logged at INFO level).
"""

from __future__ import annotations

from typing import Any

from transformers import PrinterCallback, ProgressCallback

from .hooks import carry_callback_state, trainer_callbacks, trainer_from_stack

LAYER_PREFIX = "sparsity/layer/"
"""Prefix of the per-layer sparsity scalars."""


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


_CONSOLE = ((ProgressCallback, SparsityProgressCallback), (PrinterCallback, SparsityPrinterCallback))


def move_to_front(trainer, callback) -> None:
    """Run ``callback`` before Trainer's own callbacks (so reporters like TensorBoard log its metrics)."""
    cbs = trainer_callbacks(trainer)
    if callback in cbs:
        cbs.remove(callback)
    cbs.insert(0, callback)


def arrange_logging(trainer, callback, console_layers: bool = False) -> None:
    """Run ``callback`` before the reporters and keep per-layer values off ``trainer``'s console line.

    Safe to call from inside a callback event (the list is changed in place so that the
    running loop over it neither skips nor repeats a callback).
    """
    callback._logging_arranged = True
    cbs = trainer_callbacks(trainer)
    if callback in cbs:
        move_to_front(trainer, callback)
    for i, cb in enumerate(cbs):
        for plain, filtered in _CONSOLE:
            if type(cb) is plain:
                cbs[i] = carry_callback_state(cb, filtered(show_layers=console_layers), keep=("show_layers",))
            elif type(cb) is filtered:
                cb.show_layers = console_layers


def arrange_for_callback(callback) -> None:
    """``arrange_logging`` on the running trainer, once, unless the user arranged it already."""
    if getattr(callback, "_logging_arranged", False):
        return
    trainer = trainer_from_stack()
    if trainer is not None and callback in trainer_callbacks(trainer):
        arrange_logging(trainer, callback)
