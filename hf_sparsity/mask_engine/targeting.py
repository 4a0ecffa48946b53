"""Which parameters get sparsified, at what level, and which rule decided.

The default rule: the 2-D weights of the linear
projections (Q, K, V, attention output) and feed-forward layers inside the
repeated transformer blocks, whatever the architecture names them (GPT-2
``c_attn``/``c_proj``/``c_fc`` Conv1D, Llama ``*_proj``, GPT-NeoX
``query_key_value``/``dense*``, OPT ``fc1``/``fc2``/``out_proj``, ...). Never by
default: embeddings, norms, ``lm_head``, biases and other 1-D tensors, MoE
routers, and any weight tied to an embedding. Explicit patterns override the
default entirely, as in the Cerebras docs.
"""

from __future__ import annotations

import fnmatch
import logging
import re
from dataclasses import asdict, dataclass

import torch
from torch import nn

from ..lora.view import peft_view
from ..modeling import full_shape, input_dim, linear_kind
from ..utils import SparsityError
from .config import SparsityConfig, check_structure

logger = logging.getLogger(__name__)

_BLOCK_RE = re.compile(r"\.(\d+)\.")
_EXCLUDED_NAME_PARTS = ("embed", "wte", "wpe", "norm", "ln_", "layernorm", "lm_head")
_ROUTER_RE = re.compile(r"(^|\.)(router|gate)(\.|$)")


@dataclass
class TargetDecision:
    """One parameter's verdict, as the dry run prints it."""

    name: str
    shape: tuple[int, ...]
    sparsify: bool
    rule: str
    sparsity: float | None = None
    init_method: str | None = None
    seed: int | None = None
    structure: str | None = None
    input_dim: int = 1  # the dimension a weight is multiplied along: 1 for nn.Linear, 0 for GPT-2's Conv1D

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def to_dict(self) -> dict:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip DDP / DataParallel / accelerate wrappers (``.module``) so names match the checkpoint's."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


def _embedding_tensors(model: nn.Module) -> set[int]:
    ids: set[int] = set()
    for mod in model.modules():
        if isinstance(mod, nn.Embedding):
            ids.add(id(mod.weight))
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        fn = getattr(model, getter, None)
        if fn is not None:
            try:
                m = fn()
            except Exception:  # some models raise NotImplementedError
                m = None
            if m is not None and getattr(m, "weight", None) is not None:
                ids.add(id(m.weight))
    return ids


def default_rule(
    name: str, param: torch.Tensor, owner: nn.Module | None, embedding_ids: set[int]
) -> tuple[bool, str]:
    """(sparsify?, why) under the default projection/FFN rule."""
    ndim = len(full_shape(param))  # a ZeRO-3 shard is empty here: its full shape decides
    if ndim != 2:
        return False, f"default: skip {ndim}-D tensor (biases, norms, scalars)"
    if id(param) in embedding_ids:
        return False, "default: skip embedding / lm_head (or a weight tied to one)"
    lowered = name.lower()
    for part in _EXCLUDED_NAME_PARTS:
        if part in lowered:
            return False, f"default: skip name containing {part!r}"
    if not _BLOCK_RE.search(name):
        return False, "default: skip, not inside a repeated transformer block"
    module_name = name.rsplit(".", 1)[0]
    if _ROUTER_RE.search(module_name.split(".", 1)[-1].rsplit(".", 1)[-1]) and "proj" not in module_name:
        return False, "default: skip MoE router / gate"
    kind = linear_kind(owner) if owner is not None else None
    if kind is None or not name.endswith("weight"):
        owner_name = type(owner).__name__ if owner is not None else "?"
        return False, f"default: skip, owned by {owner_name}, not a linear projection"
    return True, f"default: {kind} weight in a transformer block (projection / feed-forward)"


def _group_rules(group: SparsityConfig):
    """Yield (kind, pattern, overrides) rules of one group, in order; kind in regex|glob|default."""
    pats = group.param_name_patterns
    if isinstance(pats, str):
        yield "regex", pats, {}
    elif isinstance(pats, list):
        for p in pats:
            yield "regex", p, {}
    elif isinstance(pats, dict):
        for p, over in pats.items():
            yield "regex", p, over
    filters = group.param_filter
    if filters is not None:
        for g in [filters] if isinstance(filters, str) else filters:
            yield "glob", g, {}
    if pats is None and filters is None:
        yield "default", None, {}


def plan_sparsity(model: nn.Module, config: SparsityConfig, strict: bool = True) -> list[TargetDecision]:
    """Decide, for every parameter of ``model``, whether and how it is sparsified.

    With ``strict`` (the default) an explicit pattern that matches no parameter is an
    error: it is almost always a typo, and silently training dense is the worst outcome.
    """
    # Long by design: one pass deciding every parameter, each rule recording its reason.
    model = peft_view(unwrap_model(model))  # a PeftModel: its base weights under the plain names
    owners: dict[str, nn.Module] = {}
    for mname, mod in model.named_modules():
        for pname, _ in mod.named_parameters(recurse=False):
            owners[f"{mname}.{pname}" if mname else pname] = mod
    embedding_ids = _embedding_tensors(model)
    params = list(model.named_parameters())

    rules = []
    for gi, group in enumerate(config.iter_groups()):
        for kind, pattern, over in _group_rules(group):
            rules.append((gi, group, kind, pattern, over))
    used = {(gi, kind, pattern): False for gi, _, kind, pattern, _ in rules if kind != "default"}

    decisions = []
    for name, param in params:
        decision = None
        default_reason = None
        for gi, group, kind, pattern, over in rules:
            where = f"group {gi}: " if config.groups else ""
            if kind == "default":
                ok, why = default_rule(name, param, owners.get(name), embedding_ids)
                if not ok:
                    default_reason = default_reason or where + why
                    continue
                reason = where + why
            elif kind == "regex":
                if not re.search(pattern, name):
                    continue
                reason = f"{where}param_name_patterns {pattern!r}"
            else:
                if not fnmatch.fnmatchcase(name, pattern):
                    continue
                reason = f"{where}param_filter {pattern!r}"
            if kind != "default":
                used[(gi, kind, pattern)] = True
            level = over.get("sparsity", group.sparsity)
            if level is None:
                raise SparsityError(
                    f"Parameter {name!r} matched {reason} but no sparsity level is set for it; add "
                    "`sparsity:`."
                )
            structure = over.get("structure", group.structure)
            if structure is not None:
                n, m = check_structure(structure)
                level = 1.0 - n / m
            decision = TargetDecision(
                name=name,
                shape=tuple(full_shape(param)),
                sparsify=True,
                rule=reason,
                sparsity=float(level),
                init_method=over.get("init_method", group.init_method),
                seed=int(over.get("seed", group.seed)),
                structure=structure,
                input_dim=input_dim(owners[name]) if name in owners else 1,
            )
            break
        if decision is None:
            reason = default_reason or "no pattern matched"
            decision = TargetDecision(name=name, shape=tuple(full_shape(param)), sparsify=False, rule=reason)
        decisions.append(decision)

    if strict:
        unused = [k for k, hit in used.items() if not hit]
        if unused:
            gi, kind, pattern = unused[0]
            key = "param_name_patterns" if kind == "regex" else "param_filter"
            sample = ", ".join(n for n, _ in params[:6])
            raise SparsityError(
                f"`{key}` entry {pattern!r} matches no parameter of {type(model).__name__}. "
                f"Check the spelling against the model's parameter names (e.g. {sample}, ...); "
                "`hf_sparsity validate` lists them all."
            )
    if not any(d.sparsify for d in decisions):
        logger.warning(
            "The sparsity config selects no parameter of %s: training will be dense.", type(model).__name__
        )
    return decisions


def format_plan(decisions: list[TargetDecision]) -> str:
    """The dry-run table: every parameter, whether it is sparsified, at what level, and why."""
    w = max([len(d.name) for d in decisions] + [9])
    lines = [f"{'parameter':<{w}}  {'shape':<14} {'sparsify':<8} {'level':>6}  {'init':<6} rule"]
    for d in decisions:
        shape = "x".join(map(str, d.shape))
        level = f"{d.sparsity:.4f}" if d.sparsify else "-"
        init = d.init_method if d.sparsify else "-"
        lines.append(
            f"{d.name:<{w}}  {shape:<14} {'yes' if d.sparsify else 'no':<8} {level:>6}  {init:<6} {d.rule}"
        )
    targets = [d for d in decisions if d.sparsify]
    total = sum(d.numel for d in decisions)
    tn = sum(d.numel for d in targets)
    zeros = sum(round(d.sparsity * d.numel) for d in targets)
    lines.append(
        f"{len(targets)} of {len(decisions)} tensors sparsified; {tn:,} of {total:,} parameters targeted; "
        f"{zeros:,} zeros ({zeros / max(total, 1):.2%} of all parameters, {zeros / max(tn, 1):.2%} of "
        "targeted)."
    )
    return "\n".join(lines)


def log_plan(decisions: list[TargetDecision], level: int = logging.DEBUG) -> None:
    if logger.isEnabledFor(level):
        for line in format_plan(decisions).splitlines():
            logger.log(level, line)
