"""``MaskState``: what the engine knows about its masks, apart from enforcing them.

Masks, levels, the optimizer step count, the event history, densified tensors and a
pending LR rewind, with a JSON-simple ``state_dict`` that travels in the mask file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .. import masks as M


@dataclass
class MaskState:
    """Everything about the masks that is not enforcement: what is masked, at which level, and when."""

    masks: dict[str, torch.Tensor] = field(default_factory=dict)  # full masks, uint8, on CPU
    levels: dict[str, float] = field(default_factory=dict)
    optimizer_steps: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)
    densified: set[str] = field(default_factory=set)
    pending_rewind: int | None = None  # LR step to rewind to, applied after the scheduler's step
    extra: dict[str, Any] = field(default_factory=dict)  # callers' state carried along (FLOP counts, ...)
    seeds: dict[str, Any] | None = None  # seeds the masks were built with; a resume keeps them

    def set(self, name: str, mask: torch.Tensor | None) -> None:
        if mask is None:
            self.masks.pop(name, None)
            self.levels.pop(name, None)
            return
        self.masks[name] = mask.detach().to("cpu", M.MASK_DTYPE).contiguous()
        self.levels[name] = M.mask_level(self.masks[name])

    def state_dict(self) -> dict[str, Any]:
        """JSON-simple state saved with the masks: step count, event history, densified tensors."""
        out = dict(self.extra)
        out.update(
            {
                "optimizer_steps": self.optimizer_steps,
                "events": self.events,
                "densified": sorted(self.densified),
                "pending_rewind": self.pending_rewind,
            }
        )
        if self.seeds is not None:
            out["mask_seeds"] = dict(self.seeds)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer_steps = int(state.get("optimizer_steps", 0))
        self.events = list(state.get("events", []))
        self.densified = set(state.get("densified", []))
        self.pending_rewind = state.get("pending_rewind")
        self.seeds = state.get("mask_seeds")


def _state_field(name: str, doc: str) -> property:
    return property(
        lambda self: getattr(self.state_, name), lambda self, v: setattr(self.state_, name, v), doc=doc
    )
