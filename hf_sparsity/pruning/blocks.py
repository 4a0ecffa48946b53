"""The model's decoder blocks, the inputs the model feeds its first block, and replaying a block.

No per-architecture code: the first block's inputs are captured with a forward pre-hook,
together with every keyword argument the model passes to its blocks (the causal mask, the
position ids and, in transformers 5, the rotary ``position_embeddings``), and each block is
then called again with the same arguments.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ..modeling import linear_kind
from ..utils import SparsityError

_COMMON_PATHS = "model.layers, transformer.h, gpt_neox.layers, model.decoder.layers"


def find_blocks(model: nn.Module, target_names: list[str]) -> tuple[str, nn.ModuleList]:
    """The ``nn.ModuleList`` of repeated blocks holding most of the targeted weights, and its path."""
    best, best_hits = None, 0
    lists = []
    for path, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) == 0:
            continue
        lists.append(path)
        pat = re.compile(re.escape(path) + r"\.\d+\.")
        hits = sum(1 for n in target_names if pat.match(n))
        if hits > best_hits:
            best, best_hits = path, hits
    if best is None:
        raise SparsityError(
            f"Cannot find the decoder blocks of {type(model).__name__}: searched for an nn.ModuleList of "
            f"repeated blocks holding the targeted weights (like {_COMMON_PATHS}); its ModuleLists are "
            f"{lists or 'none'}. One-shot pruning needs a model built from a list of blocks; use "
            "--method magnitude or target the block weights with `param_name_patterns`."
        )
    return best, model.get_submodule(best)


def home_device(model: nn.Module) -> torch.device:
    """Where the model's (loaded) parameters are: the first that is not on the meta device."""
    return next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))


class _Captured(Exception):
    """Raised by the pre-hook to stop the forward once the first block's inputs are known."""

    def __init__(self, args: tuple, kwargs: dict):
        super().__init__("first block reached")
        self.args, self.kwargs = args, kwargs


@dataclass
class BlockInputs:
    """One calibration chunk: the hidden states entering a block and the other arguments of the call."""

    hidden: torch.Tensor | None
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    hidden_in_kwargs: bool = False


def to_device(obj: Any, device: torch.device | str) -> Any:
    """Move every tensor inside nested tuples / lists / dicts / :class:`BlockInputs` to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, BlockInputs):
        return replace(
            obj, hidden=to_device(obj.hidden, device), args=to_device(obj.args, device),
            kwargs=to_device(obj.kwargs, device),
        )  # fmt: skip
    if isinstance(obj, tuple):
        return tuple(to_device(o, device) for o in obj)
    if isinstance(obj, list):
        return [to_device(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


def slice_inputs(chunk: BlockInputs, lo: int, hi: int, batch: int) -> BlockInputs:
    """Windows ``lo:hi`` of a chunk of ``batch``: every tensor argument whose first dimension is the
    batch is sliced (masks, position ids); those shared by the batch (first dimension 1) are kept."""

    def cut(obj):
        if isinstance(obj, torch.Tensor):
            return obj[lo:hi] if obj.dim() and obj.shape[0] == batch and batch > 1 else obj
        if isinstance(obj, tuple):
            return tuple(cut(o) for o in obj)
        if isinstance(obj, list):
            return [cut(o) for o in obj]
        if isinstance(obj, dict):
            return {k: cut(v) for k, v in obj.items()}
        return obj

    hidden = None if chunk.hidden is None else chunk.hidden[lo:hi]
    return replace(chunk, hidden=hidden, args=cut(chunk.args), kwargs=cut(chunk.kwargs))


@torch.no_grad()
def capture_block_inputs(
    model: nn.Module, first_block: nn.Module, input_ids: torch.Tensor, batch_size: int
) -> list[BlockInputs]:
    """Run the model on ``input_ids`` in chunks, stopping at ``first_block``; return what it received."""
    captured = []

    def hook(module, args, kwargs):
        raise _Captured(args, kwargs)

    handle = first_block.register_forward_pre_hook(hook, with_kwargs=True)
    device = home_device(model)
    try:
        for chunk in input_ids.split(batch_size):
            try:
                model(input_ids=chunk.to(device), use_cache=False)
            except _Captured as c:
                kwargs = {k: v for k, v in c.kwargs.items() if k not in ("past_key_values", "layer_past")}
                if c.args:
                    captured.append(BlockInputs(c.args[0], tuple(c.args[1:]), kwargs))
                elif "hidden_states" in kwargs:
                    hidden = kwargs.pop("hidden_states")
                    captured.append(BlockInputs(hidden, (), kwargs, hidden_in_kwargs=True))
                else:
                    raise SparsityError(
                        f"The first block of {type(model).__name__} received no hidden states "
                        f"(arguments: {sorted(c.kwargs)}); one-shot pruning cannot replay it."
                    ) from None
            else:
                raise SparsityError(
                    f"{type(model).__name__}'s forward never called its first decoder block; "
                    "one-shot pruning cannot capture the block inputs."
                )
    finally:
        handle.remove()
    return captured


def call_block(block: nn.Module, chunk: BlockInputs, hidden: torch.Tensor | None = None) -> torch.Tensor:
    """Call ``block`` on one chunk (optionally with other hidden states); its output states, with grad."""
    h = chunk.hidden if hidden is None else hidden
    if chunk.hidden_in_kwargs:
        out = block(*chunk.args, hidden_states=h, **chunk.kwargs)
    else:
        out = block(h, *chunk.args, **chunk.kwargs)
    return out[0] if isinstance(out, (tuple, list)) else out


@torch.no_grad()
def run_block(block: nn.Module, chunk: BlockInputs, hidden: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`call_block` without autograd."""
    return call_block(block, chunk, hidden)


def linear_view(param: torch.Tensor, d) -> torch.Tensor:
    """A targeted weight as a float ``[out, in]`` matrix (GPT-2's Conv1D weights transposed)."""
    w = param.detach().float()
    return w.t() if d.input_dim == 0 else w


def run_all(block: nn.Module, chunks: list[BlockInputs], hidden: list) -> list[torch.Tensor]:
    """The block's outputs for every calibration chunk (``hidden``: the chunks' inputs)."""
    return [run_block(block, c, h) for c, h in zip(chunks, hidden)]


def _is_linear_weight(model: nn.Module, d) -> bool:
    owner = model.get_submodule(d.name.rsplit(".", 1)[0]) if "." in d.name else model
    return linear_kind(owner) is not None and len(d.shape) == 2 and d.name.endswith("weight")


def block_targets(model: nn.Module, prefix: str, i: int, targets: list) -> list:
    """Block ``i``'s targeted linear weights (other targeted tensors are pruned by magnitude)."""
    head = f"{prefix}.{i}."
    return [d for d in targets if d.name.startswith(head) and _is_linear_weight(model, d)]
