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

Schedules (prune / regrow / densify / SET / RigL, see :mod:`hf_sparsity.schedules`)
are compiled against ``state.max_steps`` and fire in ``on_optimizer_step``; an LR
rewind is applied in ``on_step_end``, right after the scheduler's step and before
anything is logged or saved. Every event is on :attr:`SparsityCallback.events` and
goes to the callables given to :meth:`SparsityCallback.add_listener`.

Logging (``on_log``, so TensorBoard and every other reporter get it when this
callback runs before them; :func:`move_to_front` arranges that): per-layer and
total measured sparsity of the weights, cumulative training FLOPs at the levels in
force, the dense-equivalent FLOPs and the effective (FLOP-weighted) sparsity, from
:class:`hf_sparsity.flops.FlopAccountant`. The FLOP counts travel in the mask file's
state, so they continue across resume.
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
from .engine import SparsityEngine, _is_dtensor, _local
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
        seq_len: tokens per sample, for FLOP accounting when the Trainer does not count
            tokens (``include_num_input_tokens_seen``); default: the model's context length.
        log_layers: log each layer's sparsity (``sparsity/layer/<name>``) besides the total.
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
        self._tokens_seen = 0
        self._warned_tokens = False

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
        self.engine = SparsityEngine(model, self.config, total_steps=state.max_steps or None)
        self.engine.listeners.extend(self._listeners)
        self.engine.optimizer_steps = state.global_step
        if self.config.has_schedule:
            self.engine.compile_schedule(state.max_steps)
        source = self._find_masks(args, state, model)
        if source is not None:
            actions = self.engine.restore(source, step=state.global_step)
            self.restored_from = source
            logger.info("Restored masks for %d tensors from %s", len(actions), source)
        else:
            self.engine.build_masks()
        self.engine.optimizer_steps = state.global_step
        self.engine.attach(optimizer, step_hooks=False)
        self.engine.install_save_hook()
        self._init_flops(model, state)
        set_sparsity_config(model.config, self.config, state=self.engine.state())
        return control

    def _init_flops(self, model, state) -> None:
        from .flops import FlopAccountant

        seq_len = self.seq_len or _context_length(model.config)
        try:
            self.flops = FlopAccountant(self.engine.model, targets=self.engine.targets, seq_len=seq_len)
        except Exception as e:  # an architecture the FLOP counter does not know: train anyway
            logger.warning("FLOP accounting disabled: %s", e)
            self.flops = None
            return
        saved = self.engine.restored_state.get("flops") if state.global_step > 0 else None
        if saved:
            self.flops.load_state_dict(saved)
        self._tokens_seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)

    def _step_tokens(self, args, state) -> int:
        seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        if seen > self._tokens_seen:
            n, self._tokens_seen = seen - self._tokens_seen, seen
            return n
        if not self._warned_tokens:
            logger.info(
                "FLOPs: Trainer does not count tokens (include_num_input_tokens_seen); estimating "
                "batch x accumulation x processes x %d tokens per step.",
                self.flops.seq_len,
            )
            self._warned_tokens = True
        return (
            args.per_device_train_batch_size
            * args.gradient_accumulation_steps
            * args.world_size
            * self.flops.seq_len
        )

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.engine.before_step()
        if self.flops is not None:  # this step trained at the levels in force now
            self.flops.add_tokens(self._step_tokens(args, state), self.engine.levels)
        return control

    def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
        if self.engine.pending_rewind is not None:
            if lr_scheduler is None:
                raise SparsityError("The schedule asks for an LR rewind but Trainer passed no lr_scheduler.")
            from .events import rewind_lr

            rewind_lr(lr_scheduler, self.engine.pending_rewind)
            self.engine.pending_rewind = None
        if self.flops is not None:
            self.engine.extra_state["flops"] = self.flops.state_dict()
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or self.engine is None or "loss" not in logs and "eval_loss" not in logs:
            return control
        logs.update(self.metrics())
        return control

    def metrics(self) -> dict[str, float]:
        """Measured sparsity of the weights (per layer and total) and the FLOP counts, as log scalars."""
        out: dict[str, float] = {}
        zeros = total = 0
        for name in self.engine.targets:
            p = self.engine.model.get_parameter(name)
            if _is_dtensor(p):  # no collective in a logging hook: report the mask's level
                mask = self.engine.masks.get(name)
                z = int((mask == 0).sum()) if mask is not None else 0
            else:
                z = int((_local(p).detach() == 0).sum())
            n = p.numel()
            zeros, total = zeros + z, total + n
            if self.log_layers:
                out[f"sparsity/layer/{name}"] = z / max(n, 1)
        out["sparsity/total"] = zeros / max(total, 1)
        if self.flops is not None:
            out.update(self.flops.log_dict())
        return out

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


def _context_length(config) -> int:
    for key in ("n_positions", "max_position_embeddings", "n_ctx", "seq_length"):
        v = getattr(config, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return 2048


def move_to_front(trainer, callback) -> None:
    """Run ``callback`` before Trainer's own callbacks (so reporters like TensorBoard log its metrics)."""
    cbs = trainer.callback_handler.callbacks
    if callback in cbs:
        cbs.remove(callback)
    cbs.insert(0, callback)
