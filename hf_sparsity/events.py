"""Sparsity events: what happens to the masks when the schedule says so.

Each event computes new masks and hands them to
:meth:`SparsityEngine.change_masks`, the one path that zeroes weights and
optimizer state at newly masked *and* regrown positions (DESIGN.md semantics 5):

* **prune** to a higher level: previously masked stay masked; the lowest-magnitude
  survivors join them (:func:`hf_sparsity.masks.topk_mask` with the old mask);
* **regrow** to a lower level: randomly chosen masked positions (seeded per tensor
  and step) become trainable, starting at 0 with zeroed optimizer state;
* **densify**: the mask goes away; previously masked weights start at 0;
* **update** (SET / RigL): at a constant level, drop the lowest-magnitude fraction of
  the active weights and regrow as many positions (SET: random; RigL: largest
  dense-gradient magnitude, the gradient summed over the update step's micro-batches
  and, under DDP, over ranks, so every rank picks the same positions);
* **LR rewind**: the learning-rate schedule restarts from a given step
  (:func:`rewind_lr`), applied right after the scheduler's own step.

Every event is recorded on ``engine.events`` as a JSON-simple dict (step, kind,
per-layer level before/after) and passed to each ``engine.listeners`` callable, so
other callbacks and loggers see it. Events depend only on weights, gradients, the
schedule and seeds: every rank and every rerun makes the same decision.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from . import masks as M
from .schedules import ScheduledEvent
from .utils import SparsityError

logger = logging.getLogger(__name__)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def fire_due_events(engine) -> list[dict[str, Any]]:
    """Fire every scheduled event at ``engine.optimizer_steps`` (called by ``after_step``)."""
    if engine.schedule is None:
        engine.compile_schedule()
    records = [apply_event(engine, e) for e in engine.schedule.events_at(engine.optimizer_steps)]
    arm_gradient_capture(engine)
    return records


def arm_gradient_capture(engine) -> None:
    """RigL: capture dense gradients during the backward passes of the step before an update."""
    if engine.config.algorithm != "rigl":
        return
    if engine.schedule is None:
        engine.compile_schedule()
    nxt = engine.optimizer_steps + 1
    engine._capture_grads = any(e.kind == "update" for e in engine.schedule.events_at(nxt))
    engine._captured = {}


def apply_event(engine, event: ScheduledEvent) -> dict[str, Any]:
    """Apply one event to ``engine``; returns (and records) what it did."""
    if event.kind == "update":
        new_masks = _dynamic_update(engine, event)
    else:
        new_masks = {}
        for name, d in engine.targets.items():
            want = event.level_for(d.sparsity)
            new_masks[name] = _mask_at_level(engine, name, want, event.step)
    changes = engine.change_masks(new_masks)
    kind = _kind(event, changes)
    record = {
        "step": event.step,
        "kind": kind,
        "layers": {n: {"before": c["before"], "after": c["after"]} for n, c in changes.items()},
    }
    if event.kind == "update":
        record["drop_fraction"] = event.fraction
        record["regrown"] = sum(c["regrown"] for c in changes.values())
    if event.rewind_to is not None:
        record["rewind_to"] = event.rewind_to
        engine.pending_rewind = event.rewind_to
    total = _total_level(engine)
    record["total_level"] = total
    engine.events.append(record)
    logger.info("Sparsity event at step %d: %s (total level %.4f)", event.step, kind, total)
    for listener in list(engine.listeners):
        listener(record)
    return record


def _kind(event: ScheduledEvent, changes: dict[str, dict[str, Any]]) -> str:
    if event.kind == "densify":
        return "densify"
    if event.kind == "update":
        return "update"
    up = any((c["after"] or 0.0) > (c["before"] or 0.0) + 1e-12 for c in changes.values())
    down = any((c["after"] or 0.0) < (c["before"] or 0.0) - 1e-12 for c in changes.values())
    return "prune" if up and not down else "regrow" if down and not up else "prune+regrow" if up else "noop"


def _total_level(engine) -> float:
    n = sum(d.numel for d in engine.targets.values())
    z = sum(int((m == 0).sum()) for m in engine.masks.values())
    return z / max(n, 1)


def _mask_at_level(engine, name: str, level: float | None, step: int) -> torch.Tensor | None:
    """The mask ``name`` gets at ``level``: prune by magnitude keeping old zeros, or regrow at random."""
    if level is None:
        return None
    d = engine.targets[name]
    old = engine.masks.get(name)
    weight = _full(engine.model.get_parameter(name).detach())
    if old is None:  # re-sparsifying a dense tensor: plain magnitude pruning
        return M.topk_mask(weight, level)
    return M.change_level(old, weight, level, d.seed, name, salt=f"@{step}")


def _dynamic_update(engine, event: ScheduledEvent) -> dict[str, torch.Tensor]:
    rigl = engine.config.algorithm == "rigl"
    grads: dict[str, torch.Tensor] = {}
    if rigl:
        grads = _reduced_gradients(engine)
    new_masks = {}
    for name, mask in engine.masks.items():
        d = engine.targets[name]
        weight = _full(engine.model.get_parameter(name).detach()).float().cpu()
        flat = mask.reshape(-1)
        active = flat == 1
        n_active, n_inactive = int(active.sum()), int((~active).sum())
        k = min(int(round(event.fraction * n_active)), n_inactive)
        if k <= 0:
            continue
        # Drop: the k lowest-magnitude active weights (inactive ones scored out of reach).
        drop_score = weight.reshape(-1).abs().masked_fill(~active, float("inf"))
        drop = M.lowest_k(drop_score, k)
        # Grow among positions that were inactive before this update (not the ones just dropped).
        if rigl:
            g = grads.get(name)
            if g is None:
                raise SparsityError(
                    f"RigL update at step {event.step} found no captured gradient for {name!r}. RigL needs "
                    "gradient hooks on plain (non-FSDP) parameters; use algorithm: set under FSDP2."
                )
            grow_score = (-g.reshape(-1).abs()).masked_fill(active, float("inf"))
        else:
            gen = M._generator(d.seed, name, f"set@{event.step}")
            grow_score = torch.rand(flat.numel(), generator=gen).masked_fill(active, float("inf"))
        grow = M.lowest_k(grow_score, k)
        new = flat.clone()
        new[drop] = 0
        new[grow] = 1
        new_masks[name] = new.view(mask.shape)
    engine._captured = {}
    return new_masks


def _reduced_gradients(engine) -> dict[str, torch.Tensor]:
    grads = {n: g.cpu() for n, g in engine._captured.items()}
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
        if world > 1:  # every rank must score regrowth on the same (global) gradient
            for n in sorted(grads):
                t = engine._captured[n]
                torch.distributed.all_reduce(t)
                grads[n] = t.cpu()
    return grads


def rewind_lr(scheduler: Any, step: int) -> None:
    """Restart a learning-rate schedule from ``step``: the next optimizer step uses the LR of step ``step``.

    Works for any ``LambdaLR`` (every ``transformers`` schedule) and for schedulers with a
    closed form; accelerate's wrapper is unwrapped.
    """
    sched = getattr(scheduler, "scheduler", scheduler)
    if hasattr(sched, "lr_lambdas"):
        lrs = [base * fn(step) for base, fn in zip(sched.base_lrs, sched.lr_lambdas)]
    elif hasattr(sched, "_get_closed_form_lr"):
        sched.last_epoch = step
        lrs = sched._get_closed_form_lr()
    else:
        raise SparsityError(
            f"Cannot rewind a {type(sched).__name__}: it has no closed form. Use a LambdaLR-based schedule "
            "(every transformers schedule is one) or drop `rewind_to` from the schedule."
        )
    sched.last_epoch = step
    for group, lr in zip(sched.optimizer.param_groups, lrs):
        group["lr"] = lr
    sched._last_lr = list(lrs)
