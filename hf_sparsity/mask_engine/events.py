"""Sparsity events: what happens to the masks when the schedule says so.

Pure functions: each takes the masks, weights (a ``weight(name)`` callable giving the
full tensor), seeds and gradients it needs and returns new masks; it touches no other
object. :meth:`SparsityEngine.apply_event` hands the result to
:meth:`SparsityEngine.change_masks`, the one path that zeroes weights and optimizer
state at newly masked *and* regrown positions:

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

Every event is recorded on ``engine.events`` as a JSON-simple dict
(:func:`event_record`: step, kind, per-layer level before/after) and passed to each
``engine.listeners`` callable, so other callbacks and loggers see it. Events depend only on
weights, gradients, the
schedule and seeds: every rank and every rerun makes the same decision.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .. import masks as M
from ..hooks import closed_form_lr, set_last_lr
from ..utils import SparsityError
from .schedules import ScheduledEvent

logger = logging.getLogger(__name__)


def masks_for_level_event(
    event: ScheduledEvent,
    targets: Mapping[str, Any],
    masks: Mapping[str, torch.Tensor],
    weight: Callable[[str], torch.Tensor],
) -> dict[str, torch.Tensor | None]:
    """New masks for a prune / regrow / densify event: one per target (``None``: dense)."""
    return {
        name: mask_at_level(
            masks.get(name), weight(name), event.level_for(d.sparsity), d.seed, name, event.step
        )
        for name, d in targets.items()
    }


def mask_at_level(
    old: torch.Tensor | None, weight: torch.Tensor, level: float | None, seed: int, name: str, step: int
) -> torch.Tensor | None:
    """The mask at ``level``: prune by magnitude keeping old zeros, or regrow at random (``None``: dense)."""
    if level is None:
        return None
    if old is None:  # re-sparsifying a dense tensor: plain magnitude pruning
        return M.topk_mask(weight, level)
    return M.change_level(old, weight, level, seed, name, salt=f"@{step}")


def dynamic_update(
    event: ScheduledEvent,
    masks: Mapping[str, torch.Tensor],
    seeds: Mapping[str, int],
    weight: Callable[[str], torch.Tensor],
    grads: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """SET (``grads`` None: random regrowth) or RigL (regrowth by dense-gradient magnitude) at a constant
    level.

    Drops the ``event.fraction`` lowest-magnitude active weights of each mask and regrows as many
    positions among those inactive before the update.
    """
    new_masks = {}
    for name, mask in masks.items():
        flat = mask.reshape(-1)
        active = flat == 1
        n_active, n_inactive = int(active.sum()), int((~active).sum())
        k = min(int(round(event.fraction * n_active)), n_inactive)
        if k <= 0:
            continue
        w = weight(name).float().cpu()
        # Drop: the k lowest-magnitude active weights (inactive ones scored out of reach).
        drop = M.lowest_k(w.reshape(-1).abs().masked_fill(~active, float("inf")), k)
        if grads is not None:
            g = grads.get(name)
            if g is None:
                raise SparsityError(
                    f"RigL update at step {event.step} found no captured gradient for {name!r}. RigL needs "
                    "gradient hooks on plain (non-FSDP) parameters; use algorithm: set under FSDP2."
                )
            grow_score = (-g.reshape(-1).abs()).masked_fill(active, float("inf"))
        else:
            gen = M.generator(seeds[name], name, f"set@{event.step}")
            grow_score = torch.rand(flat.numel(), generator=gen).masked_fill(active, float("inf"))
        grow = M.lowest_k(grow_score, k)
        new = flat.clone()
        new[drop] = 0
        new[grow] = 1
        new_masks[name] = new.view(mask.shape)
    return new_masks


def reduce_gradients(captured: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Captured dense gradients summed over ranks (every rank must score regrowth on the same gradient),
    on the CPU: summed where they were captured, then copied once (an update event's host work)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_world_size() > 1:
            for n in sorted(captured):
                torch.distributed.all_reduce(captured[n])
    return {n: g.cpu() for n, g in captured.items()}


def event_record(event: ScheduledEvent, changes: Mapping[str, dict[str, Any]], total_level: float) -> dict:
    """The JSON-simple record of one applied event (what listeners and the event history get)."""
    record: dict[str, Any] = {
        "step": event.step,
        "kind": event_kind(event, changes),
        "layers": {n: {"before": c["before"], "after": c["after"]} for n, c in changes.items()},
    }
    if event.kind == "update":
        record["drop_fraction"] = event.fraction
        record["regrown"] = sum(c["regrown"] for c in changes.values())
    if event.rewind_to is not None:
        record["rewind_to"] = event.rewind_to
    record["total_level"] = total_level
    return record


def event_kind(event: ScheduledEvent, changes: Mapping[str, dict[str, Any]]) -> str:
    if event.kind == "densify":
        return "densify"
    if event.kind == "update":
        return "update"
    up = any((c["after"] or 0.0) > (c["before"] or 0.0) + 1e-12 for c in changes.values())
    down = any((c["after"] or 0.0) < (c["before"] or 0.0) - 1e-12 for c in changes.values())
    return "prune" if up and not down else "regrow" if down and not up else "prune+regrow" if up else "noop"


def rewind_lr(scheduler: Any, step: int) -> None:
    """Restart a learning-rate schedule from ``step``: the next optimizer step uses the LR of step ``step``.

    Works for any ``LambdaLR`` (every ``transformers`` schedule) and for schedulers with a
    closed form; accelerate's wrapper is unwrapped.
    """
    sched = getattr(scheduler, "scheduler", scheduler)
    if hasattr(sched, "lr_lambdas"):
        lrs = [base * fn(step) for base, fn in zip(sched.base_lrs, sched.lr_lambdas)]
    else:
        lrs = closed_form_lr(sched, step)
    if lrs is None:
        raise SparsityError(
            f"Cannot rewind a {type(sched).__name__}: it has no closed form. Use a LambdaLR-based schedule "
            "(every transformers schedule is one) or drop `rewind_to` from the schedule."
        )
    sched.last_epoch = step
    for group, lr in zip(sched.optimizer.param_groups, lrs):
        group["lr"] = lr
    set_last_lr(sched, lrs)
