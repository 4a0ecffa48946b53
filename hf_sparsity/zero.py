"""DeepSpeed ZeRO: where a parameter's pieces live on this rank, so that masks reach every copy.

* **Stage 1 / 2**: every rank holds the whole (low-precision) parameter. The optimizer keeps
  the fp32 master weights and the moments in flat partitions, one per rank; DeepSpeed links
  each parameter to the piece of it that falls in this rank's partition
  (its tensor-fragment link, :func:`hf_sparsity.hooks.zero12_fragment`: the piece's offset in the
  flattened parameter, ``lp_fragment_address``, a view of the fp32 master, ``hp_fragment``, and
  after the first step views of the moments, ``optim_fragment``).
* **Stage 3**: the parameter itself is partitioned: ``param.ds_tensor`` is this rank's slice of
  the flattened parameter (``ceil(numel / world)`` elements from ``rank * that``, zero-padded
  on the last rank), ``param.ds_shape`` the full shape; a parameter DeepSpeed keeps gathered
  (small ones persist) also holds the full weight in ``param.data``. Its fp32 master and moments are read
  through DeepSpeed's public local API (``safe_get_local_fp32_param``,
  ``safe_get_local_optimizer_state``), which returns views of the optimizer's partitions.

Masks stay full-shape on every rank (built from ``ds_shape``, deterministic per name); this
module cuts the flat piece each copy needs. Nothing here imports DeepSpeed unless a parameter
is a ZeRO parameter, so the library imports and runs without it. DeepSpeed's private attributes
are read only through :mod:`hf_sparsity.hooks` (tested in ``tests/test_hooks.py``); the public
ones by ``tests/test_deepspeed.py::test_deepspeed_still_offers_what_enforcement_reads``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .hooks import is_zero12_linked, zero3_optimizer, zero12_fragment
from .utils import SparsityError


def is_zero3(p: Any) -> bool:
    """A ZeRO-3 partitioned parameter (``ds_tensor`` holds this rank's slice)."""
    return hasattr(p, "ds_id") and hasattr(p, "ds_shape")


def is_zero12(p: Any) -> bool:
    """A parameter ZeRO-1/2 linked to its fp32 master partitions. On a rank whose partition holds none
    of it the link is ``None``, but the parameter still takes part in gathers (collectives)."""
    return is_zero12_linked(p)


def is_zero(p: Any) -> bool:
    return is_zero3(p) or is_zero12(p)


def full_shape(p: torch.Tensor) -> torch.Size:
    """The parameter's whole shape (``ds_shape`` for a partitioned ZeRO-3 parameter)."""
    return torch.Size(p.ds_shape) if is_zero3(p) else p.shape


def partition_range(p: Any) -> tuple[int, int]:
    """``(start, numel)`` of this rank's ZeRO-3 slice in the flattened parameter (padding included)."""
    size = int(p.ds_tensor.ds_numel)
    rank = dist.get_rank() if dist.is_initialized() else 0
    return rank * size, size


def local_flat_mask(mask: torch.Tensor, p: Any) -> torch.Tensor:
    """The piece of a full mask matching ``p.ds_tensor`` (ZeRO-3); padding positions are kept (1)."""
    start, size = partition_range(p)
    flat = mask.reshape(-1)
    piece = flat[start : start + size]
    if piece.numel() < size:  # the last rank's padding: not a weight, left alone
        piece = torch.cat([piece, torch.ones(size - piece.numel(), dtype=mask.dtype)])
    return piece


def gathered_view(p: Any) -> torch.Tensor | None:
    """The full weight ZeRO-3 currently holds gathered on this rank (``None`` when partitioned).

    Parameters below ``stage3_param_persistence_threshold`` stay gathered between steps (DeepSpeed
    re-gathers them from the partitions after each optimizer step), so a mask change between steps
    must reach this copy too, or the next forward would still see the old weights.
    """
    if not is_zero3(p):
        return None
    data = p.data
    return data if data.numel() == int(p.ds_numel) and tuple(data.shape) == tuple(p.ds_shape) else None


def gather_full(p: Any) -> torch.Tensor:
    """The whole fp32 weight (a collective: every rank must call it, in the same order).

    The fp32 master when DeepSpeed's optimizer holds one (what a single process would prune
    by), else the gathered ZeRO-3 parameter.
    """
    shape = full_shape(p)
    if is_zero12(p) or zero3_optimizer(p) is not None:
        from deepspeed.utils import safe_get_full_fp32_param

        return safe_get_full_fp32_param(p).detach().reshape(shape).clone()
    import deepspeed

    with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
        return p.data.detach().reshape(shape).clone()


def master_mask(mask: torch.Tensor, p: Any) -> torch.Tensor:
    """The flat piece of a full mask that lines up with :func:`master_views` of ``p`` on this rank."""
    if is_zero12(p):
        fragment = zero12_fragment(p)
        if fragment is None:  # no piece of it on this rank
            return mask.new_empty(0)
        a = fragment.lp_fragment_address
        piece = mask.reshape(-1)[a.start : a.start + a.numel]
        return piece.to(fragment.hp_fragment.device)
    return local_flat_mask(mask, p).to(p.ds_tensor.device)


def master_views(p: Any) -> list[torch.Tensor]:
    """Flat views of every copy DeepSpeed's optimizer keeps of ``p`` on this rank: the fp32 master
    and each moment. Multiplying them in place masks DeepSpeed's own tensors.

    Before the first step ZeRO-1/2 has not linked its moments (they do not exist yet), so only
    the master is returned then.
    """
    if is_zero12(p):
        m = zero12_fragment(p)
        if m is None:
            return []
        return [m.hp_fragment, *(getattr(m, "optim_fragment", None) or {}).values()]
    opt = zero3_optimizer(p)
    if opt is None or not p.requires_grad:
        return []
    from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

    master = safe_get_local_fp32_param(p)
    return [master] + [safe_get_local_optimizer_state(p, k) for k in _moment_keys(opt)]


def _moment_keys(z3_optimizer: Any) -> list[str]:
    """Names of the optimizer's per-element state tensors (``exp_avg``, ...), from its partitions."""
    keys: list[str] = []
    for state in getattr(z3_optimizer.optimizer, "state", {}).values():
        for k, v in state.items():
            if torch.is_tensor(v) and v.dim() == 1 and k not in keys:
                keys.append(k)
    return keys


def check_supported(optimizer: Any) -> None:
    """Refuse DeepSpeed set-ups the enforcement does not cover, naming what works."""
    inner = getattr(optimizer, "optimizer", optimizer)
    name = type(inner).__name__
    if "Zero" not in name and "ZeRO" not in name and not hasattr(inner, "fp32_partitioned_groups_flat"):
        return
    offload = bool(getattr(inner, "cpu_offload", False)) or bool(getattr(inner, "offload_optimizer", False))
    offload = offload or bool(getattr(inner, "offload_param", False))
    if offload:
        raise SparsityError(
            "DeepSpeed offload (`offload_optimizer` / `offload_param`) is not supported with sparsity: "
            "the masks cannot reach the offloaded fp32 master weights. Remove the offload settings "
            "from the DeepSpeed config; ZeRO stages 1, 2 and 3 without offload are supported."
        )
