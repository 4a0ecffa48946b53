"""The mask engine: builds, restores, enforces and saves masks. Knows nothing about ``Trainer``.

Lifecycle::

    engine = SparsityEngine(model, config)   # plan targets (no tensors touched yet)
    engine.build_masks()                     # or engine.restore(checkpoint_dir)
    engine.attach(optimizer)                 # grad hooks + optimizer step post-hook
    ... loss.backward(); optimizer.step() ...   # enforcement runs inside the hooks
    engine.save(output_dir)                  # sparsity_masks.safetensors

Enforcement (DESIGN.md semantics 4), for every target:

* gradients are masked as they arrive (a tensor hook on the parameter, so gradient
  clipping, DDP all-reduce and gradient accumulation only ever see masked gradients);
  parameters without such a hook (FSDP2 shards) are masked in :meth:`before_step`;
* after every optimizer step, masked weights are set to exactly 0;
* every optimizer state tensor of the weight's shape (Adam moments, momentum) is 0
  at masked positions: zeroed whenever masks are set or change, and re-zeroed after
  every step unless the optimizer is one whose update provably keeps a zero state
  zero given a zero gradient and a zero weight (SGD, Adam, AdamW, Adagrad, RMSprop,
  NAdam, RAdam: their moments are sums of products of the gradient, and weight decay
  scales a zero weight). Any other optimizer (Adamax's ``exp_inf`` picks up ``eps``,
  for one) is re-masked every step. ``state_masking="always"`` forces that everywhere.

So neither weight decay nor momentum can revive a pruned weight.

FSDP2 (DTensor) parameters are supported: each rank keeps the full mask (cheap,
deterministic) and applies the slice matching its local shard.

Scheduled events (prune, regrow, densify, SET/RigL updates, LR rewind; see
:mod:`hf_sparsity.schedules` and :mod:`hf_sparsity.events`) fire inside
:meth:`after_step`, once the step count reaches their step, on every rank alike
(they depend only on the weights, the schedule and seeds, never on rank-local RNG).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from . import masks as M
from .config import SparsityConfig, check_structure, set_sparsity_config
from .constants import SPARSITY_MASKS_NAME
from .lora import peft_view
from .schedules import Schedule, compile_schedule
from .serialization import check_mask_names, load_masks, save_masks
from .targeting import TargetDecision, log_plan, plan_sparsity, unwrap_model
from .utils import SparsityError

logger = logging.getLogger(__name__)


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor" or hasattr(t, "to_local") and hasattr(t, "placements")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t


def _full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor, gathering DTensor shards (a collective: every rank must call it)."""
    return t.full_tensor() if _is_dtensor(t) else t


def _local_slice(mask: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The part of a full mask that matches ``param``'s local shard (identity for plain tensors)."""
    if not _is_dtensor(param):
        return mask
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return mask[tuple(slice(o, o + s) for o, s in zip(offset, shape))]


# Optimizers whose state stays exactly 0 where gradient, weight and state are 0 (see module docstring).
ZERO_PRESERVING_OPTIMIZERS = frozenset({"SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "NAdam", "RAdam"})


def _mask_grad(g: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    try:
        return g.mul_(m)
    except RuntimeError:  # an expanded (overlapping) gradient cannot be written in place
        return g * m


class SparsityEngine:
    """Masks for one model under one :class:`SparsityConfig`."""

    def __init__(
        self,
        model: nn.Module,
        config: SparsityConfig,
        *,
        strict: bool = True,
        state_masking: str = "auto",
        total_steps: int | None = None,
    ):
        if state_masking not in ("auto", "always"):
            raise SparsityError(f"state_masking={state_masking!r}: use 'auto' or 'always'.")
        self.state_masking = state_masking
        self.model = peft_view(unwrap_model(model))  # a PeftModel: its base model under plain names
        self.config = config
        self.plan: list[TargetDecision] = plan_sparsity(self.model, config, strict=strict)
        self.targets: dict[str, TargetDecision] = {d.name: d for d in self.plan if d.sparsify}
        log_plan(self.plan)
        self.masks: dict[str, torch.Tensor] = {}  # full masks, uint8, on CPU
        self.levels: dict[str, float] = {}
        self.optimizer_steps = 0
        self.events: list[dict[str, Any]] = []
        self._params: dict[str, torch.Tensor] = {}
        self._dev_masks: dict[str, torch.Tensor] = {}  # local slice on the parameter's device
        self._mask_by_param: dict[int, torch.Tensor] = {}
        self._grad_hooks: list[Any] = []
        self._hooked: set[str] = set()
        self._optimizers: list[torch.optim.Optimizer] = []
        self._opt_hooks: list[Any] = []
        self._orig_save_pretrained = None
        # Schedules (events.py): compiled against the real number of optimizer steps.
        self.total_steps = total_steps
        self.schedule: Schedule | None = None
        self.densified: set[str] = set()
        self.pending_rewind: int | None = None  # LR step to rewind to, applied after the scheduler's step
        self.listeners: list[Any] = []  # called with each event record
        self.extra_state: dict[str, Any] = {}  # callers' state carried in the mask file (FLOP counts, ...)
        self.restored_state: dict[str, Any] = {}
        self._lr_scheduler = None
        self._hooks_enabled = False
        self._capture_grads = False  # RigL: keep the dense gradient of the coming update step
        self._captured: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ masks
    def _param(self, name: str) -> torch.Tensor:
        return self.model.get_parameter(name)

    def build_masks(self, names: Iterable[str] | None = None) -> None:
        """Create masks for ``names`` (default: every target) from the config: random, topk or N:M."""
        for name in names if names is not None else self.targets:
            d = self.targets[name]
            level = self.target_level(name)
            if level is None:  # densified at this point of the schedule
                self.masks.pop(name, None)
                self.levels.pop(name, None)
                continue
            param = self._param(name)
            shape = tuple(param.shape)
            if d.structure is not None:
                n, m = check_structure(d.structure)
                score = (
                    M.magnitude_score(_full_tensor(param.detach()))
                    if d.init_method == "topk"
                    else torch.rand(shape, generator=M._generator(d.seed, name))
                )
                mask = M.nm_mask(score, n, m, dim=d.input_dim)
            elif d.init_method == "topk":
                mask = M.topk_mask(_full_tensor(param.detach()), level)
            else:
                mask = M.random_mask(shape, level, d.seed, name)
            self.masks[name] = mask
            self.levels[name] = M.mask_level(mask)
        self.refresh()

    # ------------------------------------------------------------------ schedule
    def compile_schedule(self, total_steps: int | None = None) -> Schedule:
        """Compile the config's schedule for a run of ``total_steps`` optimizer steps (see ``schedules.py``)."""
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

    def target_level(self, name: str, step: int | None = None) -> float | None:
        """The level ``name`` should have after ``step`` optimizer steps (None: dense, no mask)."""
        configured = self.targets[name].sparsity
        if not self.config.has_schedule:
            return None if name in self.densified else configured
        if self.schedule is None:
            self.compile_schedule()
        return self.schedule.level_at(self.optimizer_steps if step is None else step, configured)

    def set_masks(self, masks: dict[str, torch.Tensor]) -> None:
        expected = {n: tuple(self._param(n).shape) for n in self.targets}
        check_mask_names({n: {"shape": list(m.shape)} for n, m in masks.items()}, expected)
        for name, m in masks.items():
            self.masks[name] = m.detach().to("cpu", M.MASK_DTYPE).contiguous()
            self.levels[name] = M.mask_level(self.masks[name])
        self.refresh()

    def restore(
        self, path: str | os.PathLike, reconcile: bool = True, step: int | None = None
    ) -> dict[str, str]:
        """Load masks from a checkpoint folder or mask file.

        With ``reconcile`` (the seeds' resume semantics), a mask whose level differs from
        the configured one is pruned (magnitude; previously masked stay masked) or
        regrown (random positions, starting from 0); targets the file lacks get fresh
        masks from the current weights; masks for parameters no longer targeted are
        dropped (those weights become dense, keeping their zeros). Returns what was done
        per parameter. With a schedule, "configured" means the level the schedule gives
        at ``step`` (default: the step recorded in the file), so resuming mid-schedule
        changes nothing, and a tensor the schedule has densified gets no mask.
        """
        shapes = {n: tuple(p.shape) for n, p in self.model.named_parameters()}
        loaded, meta = load_masks(path, expected_shapes=shapes)
        state = meta.get("state")
        if state:
            import json

            state = json.loads(state) if isinstance(state, str) else state
            self.optimizer_steps = int(state.get("optimizer_steps", 0))
            self.events = list(state.get("events", []))
            self.densified = set(state.get("densified", []))
            self.pending_rewind = state.get("pending_rewind")
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
        for name in list(loaded):
            if self.target_level(name) is None:
                loaded.pop(name)
                self.masks.pop(name, None)
                self.levels.pop(name, None)
                actions[name] = "densified"
        self.masks.update(loaded)
        missing = [n for n in self.targets if n not in loaded and self.target_level(n) is not None]
        if missing:
            self.build_masks(missing)
            actions.update(dict.fromkeys(missing, "built"))
        for name in loaded:
            actions[name] = "restored"
            want = self.target_level(name)
            have = M.mask_level(loaded[name])
            if reconcile and M.num_zeros(want, loaded[name].numel()) != int((loaded[name] == 0).sum()):
                w = _full_tensor(self._param(name).detach())
                self.masks[name] = M.change_level(loaded[name], w, want, self.targets[name].seed, name)
                kind = "pruned" if want > have else "regrown"
                actions[name] = f"{kind} {have:.4f} -> {want:.4f}"
            self.levels[name] = M.mask_level(self.masks[name])
        changed = {n: a for n, a in actions.items() if a.startswith(("pruned", "regrown"))}
        if changed:
            self.events.append(
                {"step": self.optimizer_steps, "kind": "resume-level-change", "layers": changed}
            )
            logger.info("Resumed masks at a new level: %d tensors changed.", len(changed))
        self.refresh()
        return actions

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
                self.masks.pop(name)
                self.levels.pop(name, None)
                self.densified.add(name)
            else:
                new = new.detach().to("cpu", M.MASK_DTYPE).contiguous()
                if tuple(new.shape) != tuple(self._param(name).shape):
                    raise SparsityError(
                        f"New mask for {name!r} has shape {list(new.shape)}, the weight another."
                    )
                revived = (old == 0) & (new == 1) if old is not None else None
                self.masks[name] = new
                self.levels[name] = M.mask_level(new)
                self.densified.discard(name)
            if revived is not None and bool(revived.any()):
                self._zero_positions(name, revived)
            changes[name] = {
                "before": before,
                "after": self.levels.get(name),
                "regrown": int(revived.sum()) if revived is not None else 0,
            }
        self.refresh()
        self._rehook()
        self.apply()  # newly masked positions: weights and optimizer state to 0
        return changes

    def _zero_positions(self, name: str, where: torch.Tensor) -> None:
        """Weight and weight-shaped optimizer state of ``name`` set to 0 where ``where`` (a full-shape bool)."""
        p = self._param(name)
        keep = _local_slice((~where).to(M.MASK_DTYPE), p).to(_local(p).device)
        _local(p).mul_(keep)
        for opt in self._optimizers:
            for v in opt.state.get(p, {}).values():
                if torch.is_tensor(v) and v.shape == p.shape:
                    _local(v).mul_(keep)

    # ------------------------------------------------------------------ device views
    def refresh(self) -> None:
        """Re-read parameter objects (after ``.to()``, DDP/FSDP wrapping) and re-place the masks."""
        self._params = {n: self._param(n) for n in self.masks}
        self._dev_masks = {}
        self._mask_by_param = {}
        for name, mask in self.masks.items():
            p = self._params[name]
            local = _local_slice(mask, p).to(_local(p).device)
            self._dev_masks[name] = local
            self._mask_by_param[id(p)] = local
        if hasattr(self.model, "masks_changed"):  # peft: masked-mode adapters follow the masks
            self.model.masks_changed(self)

    def _check_params(self) -> None:
        for name, p in self._params.items():
            if self._param(name) is not p:
                self.refresh()
                self._rehook()
                return

    # ------------------------------------------------------------------ enforcement
    @torch.no_grad()
    def apply(self) -> None:
        """Zero masked weights and masked optimizer state now (call after building or changing masks)."""
        self._check_params()
        for name, p in self._params.items():
            _local(p).mul_(self._dev_masks[name])
        self._mask_optimizer_state()

    @torch.no_grad()
    def mask_gradients(self, only_unhooked: bool = True) -> None:
        for name, p in self._params.items():
            if only_unhooked and name in self._hooked:
                continue
            if p.grad is not None:
                _local(p.grad).mul_(self._dev_masks[name])

    def before_step(self) -> None:
        """Call right before ``optimizer.step()``: masks gradients the hooks could not reach.

        A pending LR rewind (from an event after the previous step) is applied here, after
        the scheduler's own step, when :meth:`attach` was given the scheduler.
        """
        self._check_params()
        if self.pending_rewind is not None and self._lr_scheduler is not None:
            from .events import rewind_lr

            rewind_lr(self._lr_scheduler, self.pending_rewind)
            self.pending_rewind = None
        self.mask_gradients(only_unhooked=True)

    @torch.no_grad()
    def after_step(self) -> None:
        """Call right after ``optimizer.step()``: weights and optimizer state exactly 0 where masked."""
        for name, p in self._params.items():
            _local(p).mul_(self._dev_masks[name])
        self._mask_optimizer_state(every_step=True)
        self.optimizer_steps += 1
        if self.config.has_schedule:
            from .events import fire_due_events

            fire_due_events(self)

    def _needs_per_step_state_masking(self, opt: torch.optim.Optimizer) -> bool:
        return self.state_masking == "always" or type(opt).__name__ not in ZERO_PRESERVING_OPTIMIZERS

    @torch.no_grad()
    def _mask_optimizer_state(self, every_step: bool = False) -> None:
        for opt in self._optimizers:
            if every_step and not self._needs_per_step_state_masking(opt):
                continue
            for p, st in opt.state.items():
                mask = self._mask_by_param.get(id(p))
                if mask is None:
                    continue
                for v in st.values():
                    if torch.is_tensor(v) and v.shape == p.shape:
                        _local(v).mul_(mask)

    def register_grad_hooks(self) -> None:
        """Mask gradients as they are produced (before clipping, DDP all-reduce and accumulation)."""
        self.remove_grad_hooks()
        for name, p in self._params.items():
            if _is_dtensor(p) or not p.requires_grad:
                continue  # FSDP2 writes sharded grads directly; masked in before_step()
            mask = self._dev_masks[name]
            # In place: the incoming gradient of a leaf weight is a fresh matmul output that
            # nothing else holds, and an out-of-place product would double the traffic.
            self._grad_hooks.append(p.register_hook(lambda g, m=mask, n=name: self._on_grad(n, g, m)))
            self._hooked.add(name)

    def _on_grad(self, name: str, g: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self._capture_grads:  # RigL scores regrowth by the dense gradient, before masking
            prev = self._captured.get(name)
            self._captured[name] = g.detach().float().clone() if prev is None else prev + g.detach().float()
        return _mask_grad(g, mask)

    def remove_grad_hooks(self) -> None:
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks, self._hooked = [], set()

    def _rehook(self) -> None:
        if self._grad_hooks or self._hooks_enabled:
            self.register_grad_hooks()

    def attach(
        self,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        step_hooks: bool = True,
        lr_scheduler: Any = None,
    ) -> None:
        """Start enforcing: gradient hooks, and (with ``step_hooks``) a post-step hook on ``optimizer``.

        ``step_hooks=False`` is for callers that call :meth:`before_step` / :meth:`after_step`
        themselves (the Trainer callback does, from its optimizer-step events).
        ``lr_scheduler``: needed for schedules with ``rewind_to`` in a plain loop (the
        rewind is applied in :meth:`before_step`; Trainer's callback applies it itself).
        """
        if not self.masks and not self.densified and not self.config.has_schedule:
            raise SparsityError("No masks yet: call build_masks() or restore(dir) before attach().")
        if lr_scheduler is not None:
            self._lr_scheduler = lr_scheduler
        self._hooks_enabled = True
        self.register_grad_hooks()
        if optimizer is not None:
            inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
            if inner not in self._optimizers:
                self._optimizers.append(inner)
            if step_hooks:
                self._opt_hooks.append(inner.register_step_pre_hook(lambda *_: self.before_step()))
                self._opt_hooks.append(inner.register_step_post_hook(lambda *_: self.after_step()))
        self.apply()
        if self.config.has_schedule:
            from .events import arm_gradient_capture

            arm_gradient_capture(self)

    def detach(self) -> None:
        self.remove_grad_hooks()
        for h in self._opt_hooks:
            h.remove()
        self._opt_hooks = []
        self.uninstall_save_hook()

    # ------------------------------------------------------------------ saving
    def state(self) -> dict[str, Any]:
        """JSON-simple state saved with the masks: step count, event history, densified tensors."""
        out = dict(self.extra_state)
        out.update(
            {
                "optimizer_steps": self.optimizer_steps,
                "events": self.events,
                "densified": sorted(self.densified),
                "pending_rewind": self.pending_rewind,
            }
        )
        return out

    def save(self, directory: str | os.PathLike, extra_metadata: dict[str, Any] | None = None) -> str:
        meta = {"state": self.state()}
        meta.update(extra_metadata or {})
        return save_masks(os.path.join(directory, SPARSITY_MASKS_NAME), self.masks, meta)

    def install_save_hook(self) -> None:
        """Make ``model.save_pretrained(dir)`` also write the masks and the config section.

        This is how Trainer checkpoints and ``trainer.save_model()`` carry the masks
        (``save_model`` does not fire ``on_save``).
        """
        if self._orig_save_pretrained is not None:
            return
        model = getattr(self.model, "peft_model", self.model)
        orig = model.save_pretrained
        self._orig_save_pretrained = orig
        engine = self

        def save_pretrained(save_directory, *args, **kwargs):
            set_sparsity_config(model.config, engine.config, state=engine.state())
            out = orig(save_directory, *args, **kwargs)
            if kwargs.get("is_main_process", True):
                engine.save(save_directory)
            return out

        save_pretrained.__doc__ = orig.__doc__
        model.save_pretrained = save_pretrained

    def uninstall_save_hook(self) -> None:
        if self._orig_save_pretrained is not None:
            getattr(self.model, "peft_model", self.model).__dict__.pop("save_pretrained", None)
            self._orig_save_pretrained = None

    # ------------------------------------------------------------------ reporting
    def report(self) -> list[dict[str, Any]]:
        """Per-tensor measured sparsity of the *weights* (not just the masks)."""
        rows = []
        for name, mask in self.masks.items():
            w = _local(self._params[name]).detach()
            zeros = int((w == 0).sum())
            rows.append(
                {
                    "name": name,
                    "shape": list(mask.shape),
                    "mask_level": self.levels[name],
                    "weight_zeros": zeros,
                    "weight_level": zeros / max(w.numel(), 1),
                }
            )
        return rows

    def format_report(self) -> str:
        rows = self.report()
        w = max([len(r["name"]) for r in rows] + [9])
        lines = [f"{'parameter':<{w}}  {'shape':<12} {'mask level':>10} {'weight zeros':>12}"]
        for r in rows:
            lines.append(
                f"{r['name']:<{w}}  {'x'.join(map(str, r['shape'])):<12} {r['mask_level']:>10.4f} "
                f"{r['weight_level']:>12.4f}"
            )
        if self.densified:
            lines.append(f"densified (no mask): {len(self.densified)} tensors")
        tn = sum(m.numel() for m in self.masks.values())
        tz = sum(int((m == 0).sum()) for m in self.masks.values())
        lines.append(f"total: {len(rows)} tensors, {tn:,} targeted parameters, level {tz / max(tn, 1):.4f}")
        return "\n".join(lines)
