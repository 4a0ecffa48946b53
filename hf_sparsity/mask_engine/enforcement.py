"""Mask enforcement: what keeps masked weights, gradients and optimizer state at exactly 0.

:class:`MaskEnforcer` owns the hooks and the device copies of the masks; it holds no
mask *state* (that is :class:`hf_sparsity.mask_engine.engine.SparsityEngine`'s) and is told the
current masks through :meth:`MaskEnforcer.place`. For every masked parameter:

* gradients are masked at the end of every backward pass, in one fused multiply over every
  targeted gradient (``torch._foreach_mul_``), so gradient clipping and gradient accumulation
  only ever see masked gradients. A tensor hook on each parameter only notes that a backward
  reached it and queues the multiply once per backward (``queue_callback``); the multiply runs
  after every callback that backward queued (DDP's all-reduce copy-back included: masking after
  the averaging gives the same gradient as averaging masked ones). DeepSpeed ZeRO parameters,
  whose gradients DeepSpeed moves into its own buffers during the backward, and RigL's dense
  gradient capture keep a multiply per gradient as it arrives; parameters without a hook (FSDP2
  shards) are masked in :meth:`before_step`;
* after every optimizer step, masked weights are exactly 0: set to 0, unless every optimizer
  is one whose update keeps a zero weight zero (below), where a zero weight with a masked
  gradient and zero state stays exactly 0 without another pass over the weights;
* every optimizer state tensor of the weight's shape (Adam moments, momentum) is 0 at
  masked positions: zeroed whenever masks are placed, and re-zeroed after every step
  unless the optimizer is one whose update provably keeps a zero state zero given a zero
  gradient and a zero weight (SGD, Adam, AdamW, Adagrad, RMSprop, NAdam, RAdam: their
  moments are sums of products of the gradient, and weight decay scales a zero weight).
  Any other optimizer (Adamax's ``exp_inf`` picks up ``eps``, for one) is re-masked every
  step; ``state_masking="always"`` forces that everywhere.

Every step stays on the device: the masks are kept on their weight's device (a copy per
parameter, made in :meth:`MaskEnforcer.place`), the per-step hooks only multiply in place and
compare Python attributes (parameter identity, device), and nothing in them reads a tensor's
value on the host (no ``.item()``, ``nonzero()``, ``bool(tensor)``, ``.cpu()``), so a CUDA
step never waits for the GPU and never copies a mask. Host work happens only where masks change
(placement, events, restore) and when they are saved; ``tests/test_host_sync.py`` counts it.
After ``model.to(device)`` (which keeps the parameter objects) the masks follow their weights:
the gradient hooks and :meth:`MaskEnforcer.before_step` see the new device and place again.

FSDP2 (DTensor) and DeepSpeed ZeRO-3 parameters: each rank keeps the full mask and applies the
slice matching its local shard (:func:`local_slice`); gradients under ZeRO-3 arrive full-shape
and are masked by the full mask. DeepSpeed ZeRO-1/2/3 also keep fp32 master weights and moments
in flat partitions inside the optimizer: :mod:`hf_sparsity.zero` finds this rank's piece of
them, masked at placement and after every step (:meth:`MaskEnforcer.mask_zero_masters`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from .. import masks as M
from .. import zero
from ..hooks import backward_task_id, dtensor_local_shape_and_offset, queue_after_backward
from ..modeling import is_dtensor, local
from ..utils import SparsityError

# Optimizers whose state stays exactly 0 where gradient, weight and state are 0 (see module docstring).
ZERO_PRESERVING_OPTIMIZERS = frozenset({"SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "NAdam", "RAdam"})


def local_slice(mask: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The part of a full mask that matches ``param``'s local shard (identity for plain tensors)."""
    if zero.is_zero3(param):
        return zero.local_flat_mask(mask, param)
    if not is_dtensor(param):
        return mask
    shape, offset = dtensor_local_shape_and_offset(param)
    return mask[tuple(slice(o, o + s) for o, s in zip(offset, shape))]


def _mask_grad(g: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    try:
        return g.mul_(m)
    except RuntimeError:  # an expanded (overlapping) gradient cannot be written in place
        return g * m


def _foreach_mask(grads: list[torch.Tensor], masks: list[torch.Tensor]) -> None:
    """``grads[i] *= masks[i]`` for every ``i``, in place, in one call (``.grad`` tensors: never expanded,
    accumulation gives them a layout of their own). The masks stay uint8 (one byte per weight, the
    memory the masks are allowed): torch multiplies tensor by tensor inside the one call, with the
    promotion to the gradient's dtype done in the kernel."""
    torch._foreach_mul_(grads, masks)


class MaskEnforcer:
    """Hooks and device masks for one model. ``place(masks)`` after every change of the masks."""

    def __init__(self, model: nn.Module, state_masking: str = "auto"):
        if state_masking not in ("auto", "always"):
            raise SparsityError(f"state_masking={state_masking!r}: use 'auto' or 'always'.")
        self.model = model
        self.state_masking = state_masking
        self.optimizers: list[torch.optim.Optimizer] = []
        self.capture_grads = False  # RigL: keep the dense gradient of the coming update step
        self.captured: dict[str, torch.Tensor] = {}
        self._masks: Mapping[str, torch.Tensor] = {}
        self._params: dict[str, torch.Tensor] = {}
        self._dev_masks: dict[str, torch.Tensor] = {}  # local slice on the parameter's device
        self._mask_by_param: dict[int, torch.Tensor] = {}
        self._grad_masks: dict[str, torch.Tensor] = {}  # full-shape where the gradient is (ZeRO-3)
        self._zero_masks: dict[str, torch.Tensor] = {}  # DeepSpeed: the piece its master copies hold
        self._grad_hooks: list[Any] = []
        self._hooked: set[str] = set()
        self._fused: dict[str, torch.Tensor] = {}  # hooked parameters masked by the end-of-backward pass
        self._queued_in = -1  # the backward (autograd graph task) the end-of-backward pass is queued in
        self._opt_hooks: list[Any] = []
        self._hooks_enabled = False

    # ------------------------------------------------------------------ placement
    def place(self, masks: Mapping[str, torch.Tensor]) -> None:
        """Re-read parameter objects (after ``.to()``, DDP/FSDP wrapping) and place ``masks`` on them.

        Copies every mask to its weight's device (host -> device): done when masks change, never per step.
        """
        self._masks = masks
        self._params = {n: self.model.get_parameter(n) for n in masks}
        self._dev_masks, self._mask_by_param, self._grad_masks, self._zero_masks = {}, {}, {}, {}
        for name, mask in masks.items():
            p = self._params[name]
            dev = local_slice(mask, p).to(local(p).device)
            self._dev_masks[name] = dev
            self._mask_by_param[id(p)] = dev
            # ZeRO-3 gathers the whole weight for backward: its gradient arrives full-shape.
            self._grad_masks[name] = mask.to(local(p).device) if zero.is_zero3(p) else dev
            if zero.is_zero(p):
                self._zero_masks[name] = zero.master_mask(mask, p)
        if self._grad_hooks or self._hooks_enabled:
            self.register_grad_hooks()

    def _check_params(self) -> bool:
        """Place the masks again when a parameter was replaced (wrapping) or moved (``model.to``, which
        keeps the parameter object); returns whether it did. Attribute reads only: no host sync."""
        if any(
            self.model.get_parameter(n) is not p or local(p).device != self._dev_masks[n].device
            for n, p in self._params.items()
        ):
            self.place(self._masks)
            return True
        return False

    # ------------------------------------------------------------------ enforcement
    @torch.no_grad()
    def apply(self) -> None:
        """Zero masked weights and masked optimizer state now."""
        self._check_params()
        for name, p in self._params.items():
            local(p).mul_(self._dev_masks[name])
        self._mask_gathered()
        self.mask_optimizer_state()
        self.mask_zero_masters()

    def _mask_gathered(self) -> None:
        """ZeRO-3: the full copies DeepSpeed keeps gathered between steps (see ``zero.gathered_view``)."""
        for name in self._zero_masks:
            full = zero.gathered_view(self._params[name])
            if full is not None:
                full.mul_(self._grad_masks[name])  # uint8 promotes in place: no copy

    @torch.no_grad()
    def zero_positions(self, name: str, where: torch.Tensor) -> None:
        """Weight and weight-shaped optimizer state of ``name`` set to 0 where ``where`` (a full-shape
        bool)."""
        p = self.model.get_parameter(name)
        keep = local_slice((~where).to(M.MASK_DTYPE), p).to(local(p).device)
        local(p).mul_(keep)
        full = zero.gathered_view(p)
        if full is not None:
            full.mul_((~where).to(full.device, full.dtype))
        for opt in self.optimizers:
            for v in opt.state.get(p, {}).values():
                if torch.is_tensor(v) and v.shape == p.shape:
                    local(v).mul_(keep)
        if zero.is_zero(p):
            piece = zero.master_mask((~where).to(M.MASK_DTYPE), p)
            for view in zero.master_views(p):
                view.mul_(piece.to(view.device, view.dtype))

    @torch.no_grad()
    def mask_gradients(self, only_unhooked: bool = True) -> None:
        for name, p in self._params.items():
            if only_unhooked and name in self._hooked:
                continue
            if p.grad is not None:
                local(p.grad).mul_(self._dev_masks[name])

    def before_step(self) -> None:
        """Right before ``optimizer.step()``: mask the gradients the hooks could not reach.

        After the parameters were replaced or moved, every gradient: the hooks that ran in this
        step's backward belonged to the parameters (or masks) of before.
        """
        replaced = self._check_params()
        self.mask_gradients(only_unhooked=not replaced)

    @torch.no_grad()
    def after_step(self) -> None:
        """Right after ``optimizer.step()``: masked weights and optimizer state exactly 0.

        When every optimizer keeps zeros zero (:data:`ZERO_PRESERVING_OPTIMIZERS`), a masked weight
        that was 0 with 0 state and a masked gradient is still exactly 0 after the step, so the
        weights are not multiplied again (one full pass over the weights less per step); with no
        optimizer registered, or any other optimizer, or ``state_masking="always"``, they are.
        """
        if self._weights_every_step():
            for name, p in self._params.items():
                local(p).mul_(self._dev_masks[name])
        self._mask_gathered()
        self.mask_optimizer_state(every_step=True)
        self.mask_zero_masters()

    @torch.no_grad()
    def mask_zero_masters(self) -> None:
        """DeepSpeed ZeRO: the optimizer's fp32 master weights and moments, on this rank's partition.

        Every step (not only for optimizers that keep zeros zero): ZeRO-1/2 link the moments only
        after the first step, and the masters are what DeepSpeed writes to its checkpoint.
        """
        for name, piece in self._zero_masks.items():
            for view in zero.master_views(self._params[name]):
                view.mul_(piece)  # the uint8 piece promotes in place: no cast copy per step

    def _weights_every_step(self) -> bool:
        return not self.optimizers or any(self.needs_per_step_state_masking(o) for o in self.optimizers)

    def needs_per_step_state_masking(self, opt: torch.optim.Optimizer) -> bool:
        return self.state_masking == "always" or type(opt).__name__ not in ZERO_PRESERVING_OPTIMIZERS

    @torch.no_grad()
    def mask_optimizer_state(self, every_step: bool = False) -> None:
        for opt in self.optimizers:
            if every_step and not self.needs_per_step_state_masking(opt):
                continue
            for p, st in opt.state.items():
                mask = self._mask_by_param.get(id(p))
                if mask is None:
                    continue
                for v in st.values():
                    if torch.is_tensor(v) and v.shape == p.shape:
                        local(v).mul_(mask)

    # ------------------------------------------------------------------ hooks
    def register_grad_hooks(self) -> None:
        """Mask gradients as they are produced (before clipping, DDP all-reduce and accumulation)."""
        self.remove_grad_hooks()
        for name, p in self._params.items():
            if is_dtensor(p) or not p.requires_grad:
                continue  # FSDP2 writes sharded grads directly; masked in before_step()
            if zero.is_zero(p):  # DeepSpeed takes the gradient during the backward: mask it as it comes
                # In place: the incoming gradient of a leaf weight is a fresh matmul output that
                # nothing else holds, and an out-of-place product would double the traffic.
                self._grad_hooks.append(p.register_hook(lambda g, n=name: self._on_grad(n, g)))
            else:
                self._fused[name] = p
                self._grad_hooks.append(p.register_hook(lambda g, n=name: self._on_grad_fused(n, g)))
            self._hooked.add(name)

    def capture_gradients(self, on: bool) -> None:
        """RigL: keep (``on``) the dense gradients of the coming backward passes; drops any kept so far."""
        self.capture_grads = bool(on)
        self.captured = {}

    def take_captured(self) -> dict[str, torch.Tensor]:
        """The dense gradients kept since :meth:`capture_gradients`, handed over (and forgotten here)."""
        captured, self.captured = self.captured, {}
        return captured

    def _on_grad(self, name: str, g: torch.Tensor) -> torch.Tensor:
        mask = self._grad_masks[name]
        if mask.device != g.device:
            # The model moved (``model.to``) since the masks were placed: one copy from the masks
            # held on the CPU, on the first backward after the move; before_step then places
            # every mask on the new device.
            p, full = self._params[name], self._masks[name]
            mask = self._grad_masks[name] = (full if zero.is_zero3(p) else local_slice(full, p)).to(g.device)
        if self.capture_grads:  # RigL scores regrowth by the dense gradient, before masking
            prev = self.captured.get(name)
            self.captured[name] = g.detach().float().clone() if prev is None else prev + g.detach().float()
        return _mask_grad(g, mask)

    def _on_grad_fused(self, name: str, g: torch.Tensor) -> torch.Tensor | None:
        """A gradient of ``name`` is on its way: queue the end-of-backward pass once per backward; the
        gradient itself goes on unchanged (RigL's capture keeps the dense one first)."""
        if self.capture_grads:
            return self._on_grad(name, g)
        task = backward_task_id()  # a backward that failed never ran its pass: no flag sticks
        if task != self._queued_in:
            self._queued_in = task
            queue_after_backward(self._after_backward)
        return None

    def _after_backward(self) -> None:
        # Queued from inside the backward; queue once more so that the pass runs after every callback
        # that backward queued after this one (DDP queues its copy of the averaged gradients late).
        queue_after_backward(self._mask_fused_grads)

    @torch.no_grad()
    def _mask_fused_grads(self) -> None:
        """Every hooked gradient times its mask, in one ``torch._foreach_mul_``."""
        self._queued_in = -1
        grads, masks = [], []
        for name, p in self._fused.items():
            g = p.grad
            if g is None:
                continue
            m = self._dev_masks[name]
            if m.device != g.device:  # the model moved since the masks were placed: placed again
                self.place(self._masks)  # (host work once, on the first backward after the move)
                return self._mask_fused_grads()
            grads.append(g)
            masks.append(m)
        if grads:
            _foreach_mask(grads, masks)

    def remove_grad_hooks(self) -> None:
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks, self._hooked, self._fused = [], set(), {}

    def enable(self) -> None:
        """Start masking gradients as they are produced (and keep doing so across :meth:`place`)."""
        self._hooks_enabled = True
        self.register_grad_hooks()

    def add_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        before: Callable[[], None] | None = None,
        after: Callable[[], None] | None = None,
    ) -> None:
        """Mask ``optimizer``'s state; with ``before`` / ``after``, call them around each of its steps."""
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
        zero.check_supported(inner)
        if inner not in self.optimizers:
            self.optimizers.append(inner)
        if before is not None:
            self._opt_hooks.append(inner.register_step_pre_hook(lambda *_: before()))
        if after is not None:
            self._opt_hooks.append(inner.register_step_post_hook(lambda *_: after()))

    def disable(self) -> None:
        self.remove_grad_hooks()
        self._hooks_enabled = False
        for h in self._opt_hooks:
            h.remove()
        self._opt_hooks = []
