"""Counting a model's FLOPs from its actual modules (:func:`count_flops`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..mask_engine.config import SparsityConfig
from ..mask_engine.targeting import plan_sparsity, unwrap_model
from ..modeling import context_length, full_numel, full_shape, linear_dims
from ..utils import SparsityError
from .report import FlopReport, LayerFlops


def _attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Top-level self-attention modules (one per block), found by class name."""
    found: list[tuple[str, nn.Module]] = []
    for name, mod in model.named_modules():
        cls = type(mod).__name__
        if not cls.endswith(("Attention", "SelfAttention")):
            continue
        if any(name.startswith(prev + ".") for prev, _ in found):
            continue  # nested helper of an attention module already counted
        found.append((name, mod))
    return found


def _heads(mod: nn.Module, config: Any) -> tuple[int, int]:
    """(query heads, head size) of one attention module; the module's own attributes win over the config."""
    heads = getattr(mod, "num_heads", None) or getattr(mod, "num_attention_heads", None)
    if heads is None and config is not None:
        heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(mod, "head_dim", None) or getattr(mod, "head_size", None)
    if head_dim is None and config is not None:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if not heads or not head_dim:
        raise SparsityError(
            f"Cannot tell the head count / head size of {type(mod).__name__}; give the config "
            "`num_attention_heads` (and `head_dim` when it is not hidden_size / heads)."
        )
    return int(heads), int(head_dim)


def attention_flops_coefficient(heads: int, head_dim: int) -> float:
    """Forward attention FLOPs per token per unit of sequence length (Chinchilla F: logits, softmax,
    reduce)."""
    return 2 * heads * head_dim + 3 * heads + 2 * heads * head_dim


def _levels_from_masks(masks: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    """name -> (numel, zeros)."""
    out = {}
    for name, m in masks.items():
        n = m.numel()
        out[name] = (n, n - int(m.sum(dtype=torch.int64)))
    return out


def _zeros(level: float, numel: int) -> int:
    return int(round(level * numel))  # the per-tensor rule of the Cerebras Model Zoo (masks.num_zeros)


def count_flops(
    model: nn.Module,
    *,
    levels: Mapping[str, float] | None = None,
    masks: Mapping[str, torch.Tensor] | None = None,
    sparsity: float | SparsityConfig | dict | None = None,
    seq_len: int | None = None,
) -> FlopReport:
    """Count parameters and FLOPs of ``model`` from its modules.

    The sparsity of each weight comes from, in order: ``masks`` (name -> 0/1 mask,
    e.g. ``SparsityEngine.masks``; exact nonzero counts), ``levels`` (name -> level,
    e.g. ``SparsityEngine.levels``), or ``sparsity`` (a level or a
    :class:`SparsityConfig`, planned with the default targeting rule). With none of
    them the model counts dense. Names are parameter names (``...c_attn.weight``).
    ``seq_len`` defaults to the config's context length.
    """
    # Long by design: one pass over the model's modules fills every figure of the report.
    model = unwrap_model(model)
    config = getattr(model, "config", None)
    seq_len = int(seq_len or context_length(config))
    if seq_len <= 0:
        raise SparsityError(f"`seq_len` must be a positive integer, got {seq_len}.")

    zeros_by_name: dict[str, tuple[int, int]] = {}
    if masks is not None:
        zeros_by_name = _levels_from_masks(masks)
    elif levels is not None:
        shapes = {n: full_numel(p) for n, p in model.named_parameters()}
        for name, lv in levels.items():
            if name not in shapes:
                raise SparsityError(
                    f"Sparsity level given for {name!r}, which {type(model).__name__} does not have."
                )
            zeros_by_name[name] = (shapes[name], _zeros(float(lv), shapes[name]))
    elif sparsity is not None:
        cfg = sparsity if isinstance(sparsity, SparsityConfig) else SparsityConfig.from_dict(sparsity)
        for d in plan_sparsity(model, cfg):
            if d.sparsify:
                zeros_by_name[d.name] = (d.numel, _zeros(d.sparsity, d.numel))

    param_names = {id(p): n for n, p in model.named_parameters()}  # tied weights: first name wins
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    in_emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    layers: list[LayerFlops] = []
    seen: set[int] = set()

    def level_of(name: str) -> tuple[int, float]:
        numel, zeros = zeros_by_name.get(name, (0, 0))
        return zeros, (zeros / numel if numel else 0.0)

    for mname, mod in model.named_modules():
        prefix = f"{mname}." if mname else ""
        shape = linear_dims(mod)
        if shape is not None and mod.weight is not None:
            w = mod.weight
            wname = param_names.get(id(w), prefix + "weight")
            d_in, d_out = shape
            zeros, level = level_of(wname)
            kind = "logits" if mod is out_emb else "linear"
            if kind == "logits":
                wname = prefix + "weight"  # its own name, even when tied to the input embedding
            n = 0 if id(w) in seen else d_in * d_out  # a tied weight's parameters count once
            layers.append(
                LayerFlops(wname, kind, (d_in, d_out), n, max(n - zeros, 0), level, 2.0 * d_in * d_out)
            )
            seen.add(id(w))
            continue
        declared = getattr(mod, "hf_sparsity_matmuls", None)
        if callable(declared):
            for pname, d_in, d_out in declared():
                p = getattr(mod, pname)
                wname = param_names.get(id(p), prefix + pname)
                zeros, level = level_of(wname)
                n = d_in * d_out
                layers.append(LayerFlops(wname, "linear", (d_in, d_out), n, n - zeros, level, 2.0 * n))
                seen.add(id(p))
        if isinstance(mod, nn.Embedding):
            w = mod.weight
            v, d = (int(x) for x in full_shape(w))
            wname = param_names.get(id(w), prefix + "weight")
            zeros, level = level_of(wname)
            n = 0 if id(w) in seen else v * d
            # Chinchilla's embedding term (2*V*d per token) belongs to token embeddings only; Cerebras'
            # FLOP counts exclude it from the totals, so it is informational.
            emb_flops = 2.0 * v * d if mod is in_emb else 0.0
            layers.append(LayerFlops(wname, "embedding", (v, d), n, max(n - zeros, 0), level, emb_flops))
            seen.add(id(w))

    attn = _attention_modules(model)
    if not attn:
        raise SparsityError(
            f"No attention module found in {type(model).__name__} (looked for classes named *Attention); "
            "the FLOP count needs one per transformer block."
        )
    for aname, amod in attn:
        heads, head_dim = _heads(amod, config)
        layers.append(
            LayerFlops(
                aname,
                "attention",
                (heads, head_dim),
                dense_flops_per_token=attention_flops_coefficient(heads, head_dim),
            )
        )

    if out_emb is not None and not any(t.kind == "logits" for t in layers):
        raise SparsityError(
            f"The output embedding of {type(model).__name__} is a {type(out_emb).__name__}, not a linear "
            "layer; the logits FLOPs cannot be counted."
        )

    total = sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once
    zeros_total = sum(z for _, z in zeros_by_name.values())
    unknown = set(zeros_by_name) - {n for n, _ in model.named_parameters()}
    if unknown:
        raise SparsityError(
            f"Masks or levels for parameter(s) the model does not have: {sorted(unknown)[:3]}."
        )
    notes = []
    counted = {t.name for t in layers}
    sparse_uncounted = [n for n, (_, z) in zeros_by_name.items() if z and n not in counted]
    if sparse_uncounted:
        notes.append(
            f"{len(sparse_uncounted)} sparse tensor(s) are not matmul weights; their FLOPs are not adjusted "
            f"(e.g. {sparse_uncounted[0]})."
        )
    return FlopReport(layers, seq_len, total, total - zeros_total, getattr(config, "model_type", ""), notes)
