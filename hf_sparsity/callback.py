"""``SparsityCallback``: the mask engine driven by ``transformers.Trainer`` events.

Order inside one Trainer update (transformers >= 4.47): clip grads ->
``on_pre_optimizer_step`` -> ``optimizer.step()`` -> ``on_optimizer_step`` ->
scheduler -> ``zero_grad`` -> ``global_step += 1`` -> ``on_step_end`` -> save
(``on_save``). Gradients are masked by tensor hooks during backward, so clipping
and DDP see masked gradients; weights and optimizer state are re-masked in
``on_optimizer_step``, before anything can be saved.

Checkpoints: the engine wraps ``model.save_pretrained`` so every Trainer checkpoint
and ``trainer.save_model()`` write ``sparsity_masks.safetensors`` and the
``sparsity`` section of ``config.json``; ``on_save`` checks the file is there.
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .config import SparsityConfig, set_sparsity_config
from .constants import SPARSITY_MASKS_NAME
from .engine import SparsityEngine
from .targeting import unwrap_model
from .utils import SparsityError

logger = logging.getLogger("hf_sparsity")


def _resume_dir_from_trainer_call() -> str | None:
    """The ``resume_from_checkpoint`` folder given to ``Trainer.train``, read from its frame.

    Trainer passes the path to no callback event; it is a local of ``train()`` /
    ``_inner_training_loop()`` (public argument name), so we read it from there.
    """
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code.co_name in ("_inner_training_loop", "train"):
                value = frame.f_locals.get("resume_from_checkpoint")
                if isinstance(value, (str, os.PathLike)) and os.path.isdir(value):
                    return str(value)
            frame = frame.f_back
    finally:
        del frame
    return None


class SparsityCallback(TrainerCallback, ExportableState):
    """Builds (or restores) masks at train begin and enforces them on every optimizer step.

    Args:
        config: a :class:`SparsityConfig`, its dict form, or a path to a YAML params file
            whose ``sparsity:`` section holds it.
        resume_from: a checkpoint folder to take masks from. Normally not needed: on
            ``trainer.train(resume_from_checkpoint=...)`` the callback finds it, and a model
            loaded with ``from_pretrained`` from a sparse folder brings its masks along.
        print_report: print the per-layer sparsity table at the end of training.
    """

    def __init__(
        self,
        config: SparsityConfig | dict | str | None = None,
        resume_from: str | None = None,
        print_report: bool = False,
    ):
        if config is None:
            raise SparsityError(
                "SparsityCallback needs a config: SparsityCallback(SparsityConfig(sparsity=0.75))."
            )
        if isinstance(config, (str, os.PathLike)):
            config = SparsityConfig.from_yaml(config)
        self.config = SparsityConfig.from_dict(config)
        self.resume_from = resume_from
        self.print_report = print_report
        self.engine: SparsityEngine | None = None
        self.restored_from: str | None = None

    # ------------------------------------------------------------------ ExportableState
    def state(self) -> dict[str, Any]:
        return {
            "args": {"config": self.config.to_dict(), "print_report": self.print_report},
            "attributes": {},
        }

    # ------------------------------------------------------------------ events
    def _find_masks(self, args, state, model) -> str | None:
        candidates = []
        if state.global_step > 0:  # resuming a Trainer checkpoint
            candidates += [
                self.resume_from,
                _resume_dir_from_trainer_call(),
                getattr(args, "resume_from_checkpoint", None),
                os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"),
            ]
        else:
            # A model loaded from a sparse folder (an earlier run's output) carries its masks.
            candidates += [self.resume_from, getattr(model.config, "_name_or_path", None)]
        for c in candidates:
            if c and os.path.isfile(os.path.join(str(c), SPARSITY_MASKS_NAME)):
                return str(c)
        if state.global_step > 0:
            raise SparsityError(
                f"Resuming at step {state.global_step} but no {SPARSITY_MASKS_NAME} was found in "
                f"{[c for c in candidates if c]}. Pass SparsityCallback(config, resume_from=CHECKPOINT_DIR)."
            )
        return None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if model is None:
            raise SparsityError("SparsityCallback.on_train_begin got no model; it must run inside Trainer.")
        if args.get_process_log_level() <= logging.DEBUG:
            _enable_debug_logging()
        model = unwrap_model(model)
        self.engine = SparsityEngine(model, self.config)
        source = self._find_masks(args, state, model)
        if source is not None:
            actions = self.engine.restore(source)
            self.restored_from = source
            logger.info("Restored masks for %d tensors from %s", len(actions), source)
        else:
            self.engine.build_masks()
        self.engine.optimizer_steps = state.global_step
        self.engine.attach(optimizer, step_hooks=False)
        self.engine.install_save_hook()
        set_sparsity_config(model.config, self.config, state=self.engine.state())
        return control

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.engine.before_step()
        return control

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.engine.after_step()
        return control

    def on_save(self, args, state, control, **kwargs):
        ckpt = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if state.is_world_process_zero and os.path.isdir(ckpt):
            if not os.path.isfile(os.path.join(ckpt, SPARSITY_MASKS_NAME)):
                # A model whose save path bypassed save_pretrained: write the masks ourselves.
                self.engine.save(ckpt, {"global_step": state.global_step})
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.engine is not None and state.is_world_process_zero:
            report = self.engine.format_report()
            logger.info("Per-layer sparsity at the end of training:\n%s", report)
            if self.print_report:
                print(report)
        return control


def _enable_debug_logging() -> None:
    pkg = logging.getLogger("hf_sparsity")
    pkg.setLevel(logging.DEBUG)
    if not pkg.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[hf_sparsity] %(message)s"))
        pkg.addHandler(handler)
