"""``SparsityCallback``: the mask engine driven by ``transformers.Trainer`` events.

``FlopCallback`` (a dense run's FLOP count) lives with the other FLOP code in
:mod:`hf_sparsity.flops.callback`.

Order inside one Trainer update (transformers >= 4.47): clip grads ->
``on_pre_optimizer_step`` -> ``optimizer.step()`` -> ``on_optimizer_step`` ->
scheduler -> ``zero_grad`` -> ``global_step += 1`` -> ``on_step_end`` -> save
(``on_save``). Gradients are masked by tensor hooks during backward, so clipping
and DDP see masked gradients; weights and optimizer state are re-masked in
``on_optimizer_step``, before anything can be saved.

Checkpoints: the mask file has one writer, ``model.save_pretrained`` as the engine carries it
(:func:`hf_sparsity.hooks.carry_masks_in_save_pretrained`): every Trainer checkpoint,
``trainer.save_model()`` (which fires no callback event) and a plain ``model.save_pretrained``
write ``sparsity_masks.safetensors`` and stamp the ``sparsity`` section of ``config.json``. It
is written with the weights, before Trainer writes ``trainer_state.json``, so a folder that
:func:`hf_sparsity.storage.resume.checkpoint_problem` calls complete has its masks; ``on_save``
(after ``trainer_state.json``) would be too late for that. ``on_save`` only checks that the
file is there (a save that bypassed ``save_pretrained`` is an error naming why) and writes the
FLOP counts.

Schedules (prune / regrow / densify / SET / RigL, see :mod:`hf_sparsity.mask_engine.schedules`)
are compiled against ``state.max_steps`` and fire in ``on_optimizer_step``; an LR
rewind is applied in ``on_step_end``, right after the scheduler's step and before
anything is logged or saved. Every event is on :attr:`SparsityCallback.events` and
goes to the callables given to :meth:`SparsityCallback.add_listener`.

Logging (``on_log``, so TensorBoard and every other reporter get it when this
callback runs before them: :func:`hf_sparsity.logging_utils.arrange_logging`, called by the user,
lists it first; nothing reorders Trainer's callbacks otherwise): per-layer (once arranged) and
total measured sparsity of the weights, cumulative training FLOPs at the levels in
force, for the tokens actually trained (padding excluded, see
:class:`hf_sparsity.flops.callback.TokenCounter`), the dense-equivalent FLOPs and the effective
(FLOP-weighted) sparsity, from :class:`hf_sparsity.flops.FlopAccountant`. The FLOP counts are
saved in every checkpoint (``flop_state.json``, the same file for sparse and dense runs), so they
continue across resume.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .constants import SPARSITY_MASKS_NAME
from .flops import FlopAccountant
from .flops.callback import (
    PendingTokens,
    TokenCounter,
    checkpoint_dir_of,
    load_flop_state,
    save_flop_state,
)
from .hooks import resume_dir_from_trainer_frame
from .logging_utils import LAYER_PREFIX, logging_arranged
from .mask_engine.config import SparsityConfig
from .mask_engine.engine import SparsityEngine
from .mask_engine.targeting import unwrap_model
from .modeling import context_length, sparsity_table
from .storage.masks_file import has_masks
from .utils import SparsityError

logger = logging.getLogger("hf_sparsity")


class SparsityCallback(TrainerCallback, ExportableState):
    """Builds (or restores) masks at train begin and enforces them on every optimizer step.

    Args:
        config: a :class:`SparsityConfig`, its dict form, or a path to a YAML params file
            whose ``sparsity:`` section holds it.
        resume_from: a checkpoint folder to take masks from. Normally not needed: on
            ``trainer.train(resume_from_checkpoint=...)`` the callback finds it, and a model
            loaded with ``from_pretrained`` from a sparse folder brings its masks along.
        print_report: print the per-layer sparsity table at the end of training.
        seq_len: tokens per sample for FLOP accounting, when the Trainer does not count tokens
            (``include_num_input_tokens_seen``); default: the real (non-padding) tokens of the
            training batches (see :class:`~hf_sparsity.flops.callback.TokenCounter`).
        log_layers: log each layer's sparsity (``sparsity/layer/<name>``) besides the total, once
            :func:`hf_sparsity.logging_utils.arrange_logging` has listed this callback ahead of the
            reporters (they get the values, the console line does not; without that call the values
            would reach no reporter and are left out). ``False``: never.
    """

    def __init__(
        self,
        config: SparsityConfig | dict | str | None = None,
        resume_from: str | None = None,
        print_report: bool = False,
        seq_len: int | None = None,
        log_layers: bool = True,
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
        self.seq_len = seq_len
        self.log_layers = log_layers
        self.flops = None
        self._listeners: list[Any] = []
        self._tokens = TokenCounter(seq_len)
        self._pending = PendingTokens()

    @property
    def events(self) -> list[dict[str, Any]]:
        """Every sparsity event so far (step, kind, per-layer level before/after), resume included."""
        return self.engine.events if self.engine is not None else []

    def add_listener(self, fn) -> None:
        """Call ``fn(record)`` on every sparsity event (prune, regrow, densify, update)."""
        self._listeners.append(fn)
        if self.engine is not None:
            self.engine.listeners.append(fn)

    # ------------------------------------------------------------------ ExportableState
    def state(self) -> dict[str, Any]:
        return {
            "args": {
                "config": self.config.to_dict(),
                "print_report": self.print_report,
                "seq_len": self.seq_len,
                "log_layers": self.log_layers,
            },
            "attributes": {},
        }

    # ------------------------------------------------------------------ events
    def _find_masks(self, args, state, model) -> str | None:
        """The one resume path: the folder whose mask file the engine starts from (``None``: build masks).

        Resuming a checkpoint (``state.global_step > 0``), the first folder holding a mask file of:
        ``SparsityCallback(resume_from=...)``; the ``resume_from_checkpoint`` given to ``Trainer.train``
        (:func:`hf_sparsity.hooks.resume_dir_from_trainer_frame`); ``args.resume_from_checkpoint``;
        ``output_dir/checkpoint-<step>``. None of them: an error naming where it looked. Starting
        fresh (step 0): ``resume_from``, then the folder the model was loaded from (another training run's
        sparse output carries its masks); none: masks are built from the config.
        """
        candidates = []
        if state.global_step > 0:  # resuming a Trainer checkpoint
            candidates += [
                self.resume_from,
                resume_dir_from_trainer_frame(),
                getattr(args, "resume_from_checkpoint", None),
                os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"),
            ]
        else:
            # A model loaded from a sparse folder (another training run's output) carries its masks.
            candidates += [self.resume_from, getattr(model.config, "name_or_path", None)]
        for c in candidates:
            if c and os.path.isdir(str(c)) and has_masks(c):
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
        self.engine = SparsityEngine(model, self.config, total_steps=state.max_steps or None)
        # First listener: the tokens trained so far are counted at the levels before the event.
        self.engine.add_listener(lambda record: self._pending.flush(self.flops))
        for fn in self._listeners:
            self.engine.add_listener(fn)
        source = self._find_masks(args, state, model)
        # Trainer's step count is the truth on a (re)start; the callback drives the step hooks itself.
        actions = self.engine.start(optimizer, step=state.global_step, resume_from=source, step_hooks=False)
        if source is not None:
            self.restored_from = source
            logger.info("Restored masks for %d tensors from %s", len(actions), source)
        self._init_flops(model, state, source)
        self._warn_unarranged(args, state)
        return control

    def _warn_unarranged(self, args, state) -> None:
        reporters = [r for r in (args.report_to or []) if r != "none"]
        if reporters and not logging_arranged(self) and state.is_world_process_zero:
            logger.warning(
                "SparsityCallback runs after the reporters Trainer lists first (report_to=%s): they get "
                "none of its sparsity/ scalars. Call hf_sparsity.logging_utils.arrange_logging(trainer, "
                "callback) after building the Trainer to list it first.",
                reporters,
            )

    def _init_flops(self, model, state, source: str | None) -> None:
        seq_len = self.seq_len or context_length(model.config)
        try:
            self.flops = FlopAccountant(self.engine.model, targets=self.engine.targets, seq_len=seq_len)
        except Exception as e:  # an architecture the FLOP counter does not know: train anyway
            logger.warning("FLOP accounting disabled: %s", e)
            self.flops = None
            return
        if state.global_step > 0:
            # Checkpoints written before FLOP counts had their own file carried them in the mask file.
            saved = load_flop_state(source) or self.engine.restored_state.get("flops")
            if saved:
                self.flops.load_state_dict(saved)
        self._tokens.start(model, state)
        self._pending = PendingTokens()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.engine.before_step()
        if self.flops is not None:  # this step trained at the levels in force now; counted lazily
            self._pending.add(self._tokens.step(args, state), self.engine.levels, self.flops)
        return control

    def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
        self.engine.apply_pending_rewind(lr_scheduler)  # right after the scheduler's step
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or self.engine is None or "loss" not in logs and "eval_loss" not in logs:
            return control
        logs.update(self.metrics())
        return control

    def metrics(self) -> dict[str, float]:
        """Measured sparsity of the weights (per layer and total) and the FLOP counts, as log scalars."""
        out: dict[str, float] = {}
        rows = sparsity_table(self.engine.model, self.engine.targets, self.engine.masks)
        if self.log_layers and logging_arranged(self):
            out.update({f"{LAYER_PREFIX}{r['name']}": r["sparsity"] for r in rows})
        out["sparsity/total"] = sum(r["zeros"] for r in rows) / max(sum(r["numel"] for r in rows), 1)
        if self.flops is not None:
            self._pending.flush(self.flops)  # host sync: only when metrics are asked for (logging)
            out.update(self.flops.log_dict())
        return out

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.engine.after_step()
        return control

    def on_save(self, args, state, control, **kwargs):
        # The mask file is not written here: save_pretrained wrote it, with the weights (module docstring).
        self._pending.flush(self.flops)  # every process: the count goes into the checkpoint
        ckpt = checkpoint_dir_of(args, state)
        if state.is_world_process_zero and os.path.isdir(ckpt):
            if not os.path.isfile(os.path.join(ckpt, SPARSITY_MASKS_NAME)):
                raise SparsityError(
                    f"{ckpt} was saved without {SPARSITY_MASKS_NAME}: Trainer saved the model without "
                    "calling its save_pretrained (a Trainer.model that is not a PreTrainedModel or "
                    "PeftModel, or FSDP with SHARDED_STATE_DICT), so the checkpoint could not be resumed "
                    "sparse. Give Trainer a transformers model, or use FSDP's FULL_STATE_DICT."
                )
            save_flop_state(ckpt, self.flops)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self._tokens.stop()
        self._pending.flush(self.flops)
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
