"""The mask engine: builds, restores, enforces and saves masks. Knows nothing about ``Trainer``.

Lifecycle::

    engine = SparsityEngine(model, config)   # plan targets (no tensors touched yet)
    engine.start(optimizer)                  # masks built (or restored: resume_from=dir, step=N),
                                             # hooks attached, save hook installed, config stamped
    ... loss.backward(); optimizer.step() ...   # enforcement runs inside the hooks
    model.save_pretrained(output_dir)        # weights, config section and sparsity_masks.safetensors
                                             # (engine.save(dir) writes the mask file alone)

Who owns what:

* :class:`MaskState` (``engine.state_``): masks, levels, the optimizer step count, the
  event history, densified tensors, a pending LR rewind; ``state_dict`` /
  ``load_state_dict`` (JSON-simple; it travels in the mask file's metadata).
* :class:`hf_sparsity.mask_engine.enforcement.MaskEnforcer` (``engine.enforcer``): hooks, optimizer-state
  zeroing, DTensor slicing; see that module for the enforcement rules.
* :mod:`hf_sparsity.mask_engine.events`: pure functions giving the new masks of an event.
* The engine: the one place that changes masks (:meth:`~SparsityEngine.change_masks`),
  sets the step count (:meth:`~SparsityEngine.start`, from the caller's count on a (re)start)
  and advances it (:meth:`~SparsityEngine.after_step`), rewinds the LR
  (:meth:`~SparsityEngine.apply_pending_rewind`) and stamps the config
  (:meth:`~SparsityEngine.stamp_config`).

Scheduled events (prune, regrow, densify, SET/RigL updates, LR rewind; see
:mod:`hf_sparsity.mask_engine.schedules`) fire inside :meth:`~SparsityEngine.after_step`, once the
step count reaches their step, on every rank alike (they depend only on the weights, the
schedule and seeds, never on rank-local RNG).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from .. import masks as M
from ..constants import SPARSITY_MASKS_NAME
from ..hooks import carry_masks_in_save_pretrained, release_save_pretrained
from ..lora.view import peft_view
from ..modeling import format_sparsity_report, full_shape, full_tensor, sparsity_table
from ..storage.folders import check_masks_match_weights
from ..storage.masks_file import check_mask_names, load_masks_for, save_masks
from ..utils import SparsityError
from . import events as E
from .config import SparsityConfig, check_structure, mask_seeds, set_sparsity_config, with_mask_seeds
from .enforcement import ZERO_PRESERVING_OPTIMIZERS, MaskEnforcer
from .mask_state import MaskState, _state_field
from .schedules import Schedule, ScheduledEvent, compile_schedule
from .targeting import TargetDecision, log_plan, plan_sparsity, unwrap_model

__all__ = ["MaskState", "SparsityEngine", "ZERO_PRESERVING_OPTIMIZERS", "carry_masks_in_save_pretrained"]

logger = logging.getLogger(__name__)


class SparsityEngine:
    """Masks for one model under one :class:`SparsityConfig`."""

    masks = _state_field("masks", "name -> full uint8 mask (CPU).")
    levels = _state_field("levels", "name -> mask level.")
    optimizer_steps = _state_field("optimizer_steps", "Optimizer steps taken (counted in after_step).")
    events = _state_field("events", "Every event record so far.")
    densified = _state_field("densified", "Targets the schedule has made dense.")
    pending_rewind = _state_field("pending_rewind", "LR step to rewind to after the scheduler's next step.")
    extra_state = _state_field("extra", "Callers' JSON-simple state carried in the mask file.")

    def __init__(
        self,
        model: nn.Module,
        config: SparsityConfig,
        *,
        strict: bool = True,
        state_masking: str = "auto",
        total_steps: int | None = None,
    ):
        self.model = peft_view(unwrap_model(model))  # a PeftModel: its base model under plain names
        self.enforcer = MaskEnforcer(self.model, state_masking)
        self.config = config
        self.plan: list[TargetDecision] = plan_sparsity(self.model, config, strict=strict)
        self.targets: dict[str, TargetDecision] = {d.name: d for d in self.plan if d.sparsify}
        log_plan(self.plan)
        self.state_ = MaskState()
        # Schedules: compiled against the real number of optimizer steps.
        self.total_steps = total_steps
        self.schedule: Schedule | None = None
        self.listeners: list[Callable[[dict[str, Any]], None]] = []  # called with each event record
        self.restored_state: dict[str, Any] = {}
        self._lr_scheduler = None
        self._pending_zero: dict[str, torch.Tensor] = {}  # restored masked positions, zeroed in attach()
        self._orig_save_pretrained = None
        self._told_seed = False

    @property
    def state_masking(self) -> str:
        return self.enforcer.state_masking

    # ------------------------------------------------------------------ masks
    def _param(self, name: str) -> torch.Tensor:
        return self.model.get_parameter(name)

    def _full_weight(self, name: str) -> torch.Tensor:
        return full_tensor(self._param(name)).detach()

    def build_masks(self, names: Iterable[str] | None = None) -> None:
        """Create masks for ``names`` (default: every target) from the config: random, topk or N:M."""
        for name in names if names is not None else self.targets:
            self.state_.set(name, self._initial_mask(name))
        if names is None:
            self.state_.seeds = mask_seeds(self.config)
        self.refresh()

    def _initial_mask(self, name: str) -> torch.Tensor | None:
        d = self.targets[name]
        level = self.target_level(name)
        if level is None:  # densified at this point of the schedule
            return None
        shape = tuple(full_shape(self._param(name)))
        if d.structure is not None:
            n, m = check_structure(d.structure)
            if d.init_method == "topk":
                score = M.magnitude_score(self._full_weight(name))
            else:
                score = torch.rand(shape, generator=M.generator(d.seed, name))
            return M.nm_mask(score, n, m, dim=d.input_dim)
        if d.init_method == "topk":
            return M.topk_mask(self._full_weight(name), level)
        return M.random_mask(shape, level, d.seed, name)

    def set_masks(self, masks: dict[str, torch.Tensor]) -> None:
        expected = {n: tuple(full_shape(self._param(n))) for n in self.targets}
        check_mask_names({n: {"shape": list(m.shape)} for n, m in masks.items()}, expected)
        for name, m in masks.items():
            self.state_.set(name, m)
        self.refresh()

    # ------------------------------------------------------------------ schedule
    def compile_schedule(self, total_steps: int | None = None) -> Schedule:
        """Compile the config's schedule for a run of ``total_steps`` optimizer steps (see
        ``schedules.py``)."""
        if total_steps is not None:
            self.total_steps = int(total_steps)
        self.schedule = compile_schedule(self.config, self.total_steps)
        if self.schedule.events:
            logger.info(
                "Sparsity schedule (%s): %d events, steps %d..%d.",
                self.schedule.algorithm,
                len(self.schedule.events),
                self.schedule.events[0].step,
                self.schedule.events[-1].step,
            )
        return self.schedule

    def _schedule(self) -> Schedule:
        return self.schedule if self.schedule is not None else self.compile_schedule()

    def target_level(self, name: str, step: int | None = None) -> float | None:
        """The level ``name`` should have after ``step`` optimizer steps (None: dense, no mask)."""
        configured = self.targets[name].sparsity
        if not self.config.has_schedule:
            return None if name in self.densified else configured
        return self._schedule().level_at(self.optimizer_steps if step is None else step, configured)

    # ------------------------------------------------------------------ starting
    def add_listener(self, fn: Callable[[dict[str, Any]], None]) -> None:
        """Call ``fn(record)`` on every sparsity event (prune, regrow, densify, update)."""
        self.listeners.append(fn)

    def start(
        self,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        step: int = 0,
        resume_from: str | os.PathLike | None = None,
        lr_scheduler: Any = None,
        step_hooks: bool = True,
    ) -> dict[str, str]:
        """Begin enforcing, at optimizer step ``step`` (the caller's count is the truth on a (re)start).

        Compiles the schedule, builds the masks (or restores them from ``resume_from``, reconciled to
        the level wanted at ``step``; see :meth:`restore`), attaches the hooks (:meth:`attach`), makes
        ``save_pretrained`` carry the masks and stamps the config. Returns what a restore did per tensor
        (empty when the masks were built).
        """
        self.optimizer_steps = int(step)
        if self.config.has_schedule:
            self.compile_schedule()
        actions: dict[str, str] = {}
        if resume_from is not None:
            actions = self.restore(resume_from, step=step)
        else:
            self.build_masks()
        self.attach(optimizer, step_hooks=step_hooks, lr_scheduler=lr_scheduler)
        self.install_save_hook()
        self.stamp_config()
        return actions

    # ------------------------------------------------------------------ save / restore
    def state(self) -> dict[str, Any]:
        """JSON-simple state saved with the masks: step count, event history, densified tensors."""
        return self.state_.state_dict()

    def save(self, directory: str | os.PathLike, extra_metadata: dict[str, Any] | None = None) -> str:
        """Write the masks and the state to ``directory/sparsity_masks.safetensors`` (atomically)."""
        meta = {"state": self.state()}
        meta.update(extra_metadata or {})
        return save_masks(os.path.join(directory, SPARSITY_MASKS_NAME), self.masks, meta)

    def restore(
        self, path: str | os.PathLike, reconcile: bool = True, step: int | None = None
    ) -> dict[str, str]:
        """Load masks from a checkpoint folder or mask file.

        With ``reconcile`` (the Cerebras Model Zoo's resume semantics), a mask whose level differs from
        the configured one is pruned (magnitude; previously masked stay masked) or
        regrown (random positions, starting from 0); targets the file lacks get fresh
        masks from the current weights; masks for parameters no longer targeted are
        dropped (those weights become dense, keeping their zeros). Every position the
        file masks starts from 0 (weight now, optimizer state at :meth:`attach`). Returns
        what was done per parameter. With a schedule, "configured" means the level the
        schedule gives at ``step`` (default: the step recorded in the file), so resuming
        mid-schedule changes nothing, and a tensor the schedule has densified gets no mask.
        """
        loaded, meta = load_masks_for(self.model, path, required=True, with_metadata=True)
        check_masks_match_weights(path, loaded)
        state = meta.get("state")
        if state:
            state = json.loads(state) if isinstance(state, str) else state
            self.state_.load_state_dict(state)
            self.restored_state = dict(state)
        if step is not None:
            self.optimizer_steps = int(step)
        actions: dict[str, str] = {}
        for name in list(loaded):
            if name not in self.targets:
                logger.warning(
                    "Mask for %s in %s is no longer targeted by the config: dropping it.", name, path
                )
                loaded.pop(name)
                actions[name] = "dropped"
            elif self.target_level(name) is None:
                loaded.pop(name)
                self.state_.set(name, None)
                actions[name] = "densified"
        missing = [n for n in self.targets if n not in loaded and self.target_level(n) is not None]
        if missing:
            self.build_masks(missing)
            actions.update(dict.fromkeys(missing, "built"))
        for name, mask in loaded.items():
            actions[name] = self._reconcile(name, mask) if reconcile else "restored"
            if not reconcile:
                self.state_.set(name, mask)
            # Positions the file masks start from 0, whether they stay masked or are regrown:
            # a checkpoint's stale values never revive.
            self.enforcer.zero_positions(name, mask == 0)
            self._pending_zero[name] = mask == 0
        changed = {n: a for n, a in actions.items() if a.startswith(("pruned", "regrown"))}
        if changed:
            self.events.append(
                {"step": self.optimizer_steps, "kind": "resume-level-change", "layers": changed}
            )
            logger.info("Resumed masks at a new level: %d tensors changed.", len(changed))
        self.refresh()
        return actions

    def _reconcile(self, name: str, loaded: torch.Tensor) -> str:
        """Take ``loaded`` as ``name``'s mask, pruned or regrown to the level wanted now."""
        want, have = self.target_level(name), M.mask_level(loaded)
        if M.num_zeros(want, loaded.numel()) == int((loaded == 0).sum()):
            self.state_.set(name, loaded)
            return "restored"
        new = M.change_level(loaded, self._full_weight(name), want, self.targets[name].seed, name)
        self.state_.set(name, new)
        return f"{'pruned' if want > have else 'regrown'} {have:.4f} -> {want:.4f}"

    def stamp_config(self) -> None:
        """Write the config and the current state into ``model.config`` (so ``config.json`` carries them).

        The seed written is the one the masks were built with, when a resume configured another.
        """
        config = with_mask_seeds(self.config, self.state_.seeds)
        if config is not self.config and not self._told_seed:
            self._told_seed = True
            logger.warning(
                "The masks were built with seeds %s, the config now gives %s: config.json keeps the "
                "former (the new seeds only affect masks built or regrown from now on).",
                self.state_.seeds,
                mask_seeds(self.config),
            )
        set_sparsity_config(self.model.config, config, state=self.state())

    def install_save_hook(self) -> None:
        """Make ``model.save_pretrained(dir)`` also write the masks and the config section."""
        if self._orig_save_pretrained is None:
            self._orig_save_pretrained = carry_masks_in_save_pretrained(self.model, self)

    def uninstall_save_hook(self) -> None:
        if self._orig_save_pretrained is not None:
            release_save_pretrained(self.model)
            self._orig_save_pretrained = None

    # ------------------------------------------------------------------ changing masks
    @torch.no_grad()
    def change_masks(self, new_masks: dict[str, torch.Tensor | None]) -> dict[str, dict[str, Any]]:
        """Replace masks mid-training (every event goes through here); ``None`` densifies a tensor.

        Newly masked positions: weight and weight-shaped optimizer state set to 0.
        Regrown positions (masked before, trainable now) and, on densify, every
        previously masked position: weight and optimizer state set to 0 too, so they start
        from 0 whatever happened to them while masked. Returns, per tensor, the counts.
        """
        changes: dict[str, dict[str, Any]] = {}
        for name, new in new_masks.items():
            if name not in self.targets:
                raise SparsityError(
                    f"{name!r} is not a sparsity target of this model; cannot change its mask."
                )
            old = self.masks.get(name)
            before = self.levels.get(name) if old is not None else None
            if new is None:
                if old is None:
                    continue
                revived = old == 0
                self.densified.add(name)
            else:
                if tuple(new.shape) != tuple(full_shape(self._param(name))):
                    raise SparsityError(
                        f"New mask for {name!r} has shape {list(new.shape)}, the weight another."
                    )
                revived = (old == 0) & (new.to(M.MASK_DTYPE) == 1) if old is not None else None
                self.densified.discard(name)
            self.state_.set(name, new)
            if revived is not None and bool(revived.any()):
                self.enforcer.zero_positions(name, revived)
            changes[name] = {
                "before": before,
                "after": self.levels.get(name),
                "regrown": int(revived.sum()) if revived is not None else 0,
            }
        self.refresh()
        self.enforcer.apply()  # newly masked positions: weights and optimizer state to 0
        return changes

    def apply_event(self, event: ScheduledEvent) -> dict[str, Any]:
        """Apply one scheduled event; returns (and records, and tells the listeners) what it did."""
        if event.kind == "update":
            grads = None
            captured = self.enforcer.take_captured()
            if self.config.algorithm == "rigl":
                grads = E.reduce_gradients(captured)
            seeds = {n: d.seed for n, d in self.targets.items()}
            new_masks = E.dynamic_update(event, self.masks, seeds, self._full_weight, grads)
        else:
            new_masks = E.masks_for_level_event(event, self.targets, self.masks, self._full_weight)
        changes = self.change_masks(new_masks)
        record = E.event_record(event, changes, self.total_level())
        if event.rewind_to is not None:
            self.pending_rewind = event.rewind_to
        self.events.append(record)
        logger.info(
            "Sparsity event at step %d: %s (total level %.4f)",
            event.step,
            record["kind"],
            record["total_level"],
        )
        for listener in list(self.listeners):
            listener(record)
        return record

    def fire_due_events(self) -> list[dict[str, Any]]:
        """Fire every scheduled event at the current step count (``after_step`` calls this)."""
        records = [self.apply_event(e) for e in self._schedule().events_at(self.optimizer_steps)]
        self._arm_gradient_capture()
        return records

    def _arm_gradient_capture(self) -> None:
        """RigL: capture dense gradients during the backward passes of the step before an update."""
        if self.config.algorithm != "rigl":
            return
        nxt = self.optimizer_steps + 1
        self.enforcer.capture_gradients(any(e.kind == "update" for e in self._schedule().events_at(nxt)))

    def apply_pending_rewind(self, lr_scheduler: Any) -> None:
        """The one place an LR rewind happens: call right after the scheduler's own step."""
        if self.pending_rewind is None:
            return
        if lr_scheduler is None:
            raise SparsityError("The schedule asks for an LR rewind but no lr_scheduler was given.")
        E.rewind_lr(lr_scheduler, self.pending_rewind)
        self.pending_rewind = None

    def total_level(self) -> float:
        n = sum(d.numel for d in self.targets.values())
        return sum(int((m == 0).sum()) for m in self.masks.values()) / max(n, 1)

    # ------------------------------------------------------------------ enforcement
    def refresh(self) -> None:
        """Re-read parameter objects (after ``.to()``, DDP/FSDP wrapping) and re-place the masks."""
        self.enforcer.place(self.masks)
        if hasattr(self.model, "masks_changed"):  # peft: masked-mode adapters follow the masks
            self.model.masks_changed(self)

    def apply(self) -> None:
        """Zero masked weights and masked optimizer state now (call after building or changing masks)."""
        self.enforcer.apply()

    def mask_gradients(self, only_unhooked: bool = True) -> None:
        self.enforcer.mask_gradients(only_unhooked)

    def register_grad_hooks(self) -> None:
        """Mask gradients as they are produced (before clipping, DDP all-reduce and accumulation)."""
        self.enforcer.register_grad_hooks()

    def remove_grad_hooks(self) -> None:
        self.enforcer.remove_grad_hooks()

    def before_step(self) -> None:
        """Call right before ``optimizer.step()``: masks gradients the hooks could not reach.

        In a plain loop, a pending LR rewind (from an event after the previous step) is
        applied here, after the scheduler's own step, when :meth:`attach` was given the scheduler.
        """
        if self._lr_scheduler is not None:
            self.apply_pending_rewind(self._lr_scheduler)
        self.enforcer.before_step()

    def after_step(self) -> None:
        """Call right after ``optimizer.step()``: weights and optimizer state exactly 0 where masked;
        the one place the step count advances and scheduled events fire."""
        self.enforcer.after_step()
        self.optimizer_steps += 1
        if self.config.has_schedule:
            self.fire_due_events()

    def attach(
        self,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        step_hooks: bool = True,
        lr_scheduler: Any = None,
    ) -> None:
        """Start enforcing: gradient hooks, and (with ``step_hooks``) step hooks on ``optimizer``.

        ``step_hooks=False`` is for callers that call :meth:`before_step` / :meth:`after_step`
        themselves (the Trainer callback does, from its optimizer-step events).
        ``lr_scheduler``: needed for schedules with ``rewind_to`` in a plain loop (the
        rewind is applied in :meth:`before_step`; Trainer's callback applies it itself).
        """
        if not self.masks and not self.densified and not self.config.has_schedule:
            raise SparsityError("No masks yet: call build_masks() or restore(dir) before attach().")
        if lr_scheduler is not None:
            self._lr_scheduler = lr_scheduler
        self.enforcer.enable()
        if optimizer is not None:
            hooks = (self.before_step, self.after_step) if step_hooks else (None, None)
            self.enforcer.add_optimizer(optimizer, *hooks)
        for name, where in self._pending_zero.items():
            if name in self.masks:
                self.enforcer.zero_positions(name, where)
        self._pending_zero = {}
        self.enforcer.apply()
        if self.config.has_schedule:
            self._arm_gradient_capture()

    def detach(self) -> None:
        self.enforcer.disable()
        self.uninstall_save_hook()

    # ------------------------------------------------------------------ reporting
    def report(self) -> list[dict[str, Any]]:
        """Per-tensor measured sparsity of the *weights* (not just the masks)."""
        return [
            {
                "name": r["name"],
                "shape": r["shape"],
                "mask_level": self.levels[r["name"]],
                "weight_zeros": r["zeros"],
                "weight_level": r["sparsity"],
            }
            for r in sparsity_table(self.model, self.masks, self.masks)
        ]

    def format_report(self) -> str:
        """:meth:`report` as a table with the totals (``print_report`` prints it after training)."""
        return format_sparsity_report(self.report(), self.masks, self.densified)
