"""The two places hf_sparsity reaches into transformers where there is no public way in.

Each is one named function;
``tests/test_checkpoints.py::test_trainer_still_offers_what_the_two_hooks_rely_on`` fails by
name if a transformers release moves what it relies on.

* :func:`carry_masks_in_save_pretrained`: ``Trainer.save_model()`` fires no callback event, so
  the masks and the config section ride on ``model.save_pretrained``.
* :func:`resume_dir_from_trainer_frame`: Trainer passes the ``resume_from_checkpoint`` folder
  to no callback event, so it is read from ``Trainer.train``'s frame; :func:`trainer_from_stack`
  (the running trainer, for arranging console logging) reads ``self`` from the same frames.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

from torch import nn

TRAINER_FRAMES = ("_inner_training_loop", "train")


def resume_dir_from_trainer_frame() -> str | None:
    """The ``resume_from_checkpoint`` folder given to ``Trainer.train``, read from its frame.

    The one frame read in the library, because there is no public way in: Trainer passes the
    path to no callback event and keeps it nowhere on ``state`` or ``args``. It is an argument
    of ``Trainer.train`` and ``Trainer._inner_training_loop`` (:data:`TRAINER_FRAMES`).
    ``tests/test_checkpoints.py::test_resume_dir_is_read_from_trainer`` fails loudly when a
    transformers release moves it. Without it, resuming still works when the checkpoint is
    ``output_dir/checkpoint-<step>`` or is passed as ``SparsityCallback(resume_from=...)``.
    """
    value = _trainer_frame_local(
        "resume_from_checkpoint", lambda v: isinstance(v, (str, os.PathLike)) and os.path.isdir(v)
    )
    return None if value is None else str(value)


def trainer_from_stack():
    """The ``transformers.Trainer`` whose ``train()`` is running (its methods' ``self``), or ``None``."""
    from transformers import Trainer

    return _trainer_frame_local("self", lambda v: isinstance(v, Trainer))


def _trainer_frame_local(key: str, accept: Callable[[Any], bool]) -> Any:
    """The first local ``key`` that ``accept``s, in a :data:`TRAINER_FRAMES` frame up the stack."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code.co_name in TRAINER_FRAMES:
                value = frame.f_locals.get(key)
                if value is not None and accept(value):
                    return value
            frame = frame.f_back
    finally:
        del frame
    return None


def carry_masks_in_save_pretrained(model: nn.Module, engine: Any) -> Callable:
    """Make ``model.save_pretrained(dir)`` also stamp the config and write the masks; returns the original.

    The one place the library replaces a method on an instance, because there is no public
    way in: ``Trainer.save_model()`` fires no callback event, and both it and every
    checkpoint save go through ``model.save_pretrained``. ``tests/test_checkpoints.py``
    fails loudly if Trainer stops calling it. Under a peft view (:mod:`hf_sparsity.lora`) the
    ``PeftModel`` is the module that saves.
    """
    model = getattr(model, "peft_model", model)
    orig = model.save_pretrained

    def save_pretrained(save_directory, *args, **kwargs):
        engine.stamp_config()
        out = orig(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            engine.save(save_directory)
        return out

    save_pretrained.__doc__ = orig.__doc__
    model.save_pretrained = save_pretrained
    return orig


def release_save_pretrained(model: nn.Module) -> None:
    """Undo :func:`carry_masks_in_save_pretrained`: the class's own ``save_pretrained`` again."""
    getattr(model, "peft_model", model).__dict__.pop("save_pretrained", None)
