"""Sparse-IFT: transform a model config so each projection / FFN layer is iso-FLOP at a sparsity.

Thangarasa et al. 2023, "Sparse-IFT", arXiv:2303.11525. Given a sparsity ``s``,
every layer the default targeting rule picks (Q/K/V, attention output and MLP
matrices of every block) is made larger and sparse so that its FLOPs stay those
of the dense original:

* ``wide``: ``d_model`` and the FFN width times ``1/sqrt(1 - s)``, ``d_model``
  rounded to the nearest width the heads allow (a multiple of the head count,
  with an even rotary dimension for RoPE models); GPT-3 Small at 50% gives 1092,
  Cerebras' figure. A stock architecture, just a wider config.
* ``parallel``: ``k = round(1 / (1 - s))`` sparse copies of the layer, summed.
* ``factorized``: ``W -> V U`` with inner width ``d_in d_out / ((1 - s)(d_in + d_out))``.
* ``doped``: sparse ``W`` at ``s`` plus a dense rank ``s d_in d_out / (d_in + d_out)`` term.

Widths are integers, so each transformed tensor gets its own level, computed so
the layer's nonzero multiply-adds equal the original's (to the rounding of one
weight); the config carries these levels as a ``sparsity`` section with one
pattern per layer, ready for ``SparsityCallback``. Embeddings, positional
embeddings, norms, attention logits/softmax and the LM head are not transformed:
under ``wide`` they grow with ``d_model`` and make the whole model costlier than
the original, which :class:`IFTResult` reports term by term.

Usage::

    result = sparse_ift("gpt2-small/config.json", 0.5, "wide")
    print(result.format())
    result.save("out/gpt2-small-wide50")       # config.json (+ modeling_sparse_ift.py)
    model = build_ift_model(result.config)     # or AutoModelForCausalLM.from_config(...)
"""

from __future__ import annotations

import copy
import math
import os
import re
from typing import Any

from ..constants import CONFIG_NAME
from ..flops import build_meta_model, count_flops, load_config
from ..mask_engine.config import SparsityConfig, check_level, get_sparsity_config, set_sparsity_config
from ..mask_engine.targeting import plan_sparsity
from ..utils import SparsityError
from .models import (
    IFT_SECTION,
    TRANSFORMS,
    build_ift_model,
    linear_dims,
)
from .result import IFTLayer, IFTResult

__all__ = ["IFTLayer", "IFTResult", "TRANSFORMS", "build_ift_model", "sparse_ift", "wide_width"]

_BLOCK_RE = re.compile(r"\.\d+\.")
_FFN_KEYS = ("intermediate_size", "ffn_dim", "n_inner")


def _rope_fraction(config: Any) -> float | None:
    """Fraction of each head that is rotary (None: no RoPE)."""
    rp = getattr(config, "rope_parameters", None)
    if isinstance(rp, dict) and rp:
        return float(rp.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0))
    for key in ("partial_rotary_factor", "rotary_pct"):
        v = getattr(config, key, None)
        if v is not None:
            return float(v)
    if (
        getattr(config, "rope_theta", None) is not None
        or getattr(config, "rotary_emb_base", None) is not None
    ):
        return 1.0
    return None


def _width_ok(config: Any, d: int) -> bool:
    heads = int(config.num_attention_heads)
    if d % heads:
        return False
    frac = _rope_fraction(config)
    if frac is None:
        return True
    hd = d // heads
    return hd % 2 == 0 and int(hd * frac) % 2 == 0  # rotary halves need an even dimension


def wide_width(config: Any, sparsity: float) -> int:
    """Sparse-Wide ``d_model``: ``d / sqrt(1 - s)`` rounded to the nearest width the heads allow, >= ``d``."""
    d = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    target = d / math.sqrt(1.0 - sparsity)
    base = heads * round(target / heads)
    for step in range(0, 64 * heads + 1, heads):  # nearest valid multiple of the head count, either side
        for cand in sorted({base - step, base + step}, key=lambda c: (abs(c - target), -c)):
            if cand >= d and _width_ok(config, cand):
                return cand
    raise SparsityError(f"No valid Sparse-Wide width near {target:.1f} for {heads} heads.")


def _ffn_key(config: Any) -> str | None:
    for key in _FFN_KEYS:
        if key in config.to_dict() or getattr(config, key, None) is not None:
            return key
    return None


def _widen_config(config: Any, sparsity: float) -> tuple[Any, dict[str, tuple[Any, Any]]]:
    new = copy.deepcopy(config)
    d = int(config.hidden_size)
    d_new = wide_width(config, sparsity)
    heads = int(config.num_attention_heads)
    changes: dict[str, tuple[Any, Any]] = {"hidden_size": (d, d_new)}
    new.hidden_size = d_new
    key = _ffn_key(config)
    if key is not None:
        ffn = getattr(config, key, None) or 4 * d  # GPT-2's n_inner=None means 4*d
        ffn_new = round(ffn * d_new / d)  # keep the FFN/d_model ratio
        setattr(new, key, ffn_new)
        changes[key] = (ffn, ffn_new)
    if getattr(config, "head_dim", None) is not None:
        changes["head_dim"] = (config.head_dim, d_new // heads)
        new.head_dim = d_new // heads
    if getattr(config, "word_embed_proj_dim", None) == d:  # OPT: embeddings follow d_model unless projected
        new.word_embed_proj_dim = d_new
        changes["word_embed_proj_dim"] = (d, d_new)
    return new, changes


def _module_spec(
    transform: str, sparsity: float, d_in: int, d_out: int
) -> tuple[dict[str, int], list[tuple[str, tuple[int, int], float]]]:
    """The layer's ``sparse_ift`` spec and its (sub-parameter, shape, level) list, iso-FLOP with d_in x
    d_out."""
    n = d_in * d_out
    if transform == "parallel":
        k = max(1, round(1.0 / (1.0 - sparsity)))
        lv = 1.0 - 1.0 / k  # k branches at density 1/k: exactly one dense layer's multiply-adds
        return {"k": k}, [(f"branches.{i}.weight", (d_in, d_out), lv) for i in range(k)]
    if transform == "factorized":
        rank = max(1, round(n / ((1.0 - sparsity) * (d_in + d_out))))
        lv = max(0.0, 1.0 - n / (rank * (d_in + d_out)))
        return {"rank": rank}, [("u.weight", (d_in, rank), lv), ("v.weight", (rank, d_out), lv)]
    if transform == "doped":
        rank = round(sparsity * n / (d_in + d_out))
        lv = rank * (d_in + d_out) / n  # the sparse part gives up what the dense low-rank term costs
        tensors = [("sparse.weight", (d_in, d_out), lv)]
        if rank:
            tensors += [("low_rank_a", (d_in, rank), 0.0), ("low_rank_b", (rank, d_out), 0.0)]
        return {"rank": rank}, tensors
    raise SparsityError(f"Unknown transform {transform!r}; use one of {', '.join(TRANSFORMS)}.")


def _patterns(levels: dict[str, float]) -> dict[str, dict[str, float]]:
    """One regex per layer group (block index folded) when all its blocks share a level, else one per
    tensor."""
    by_group: dict[str, dict[str, float]] = {}
    for name, lv in levels.items():
        pattern = "^" + r"\.\d+\.".join(re.escape(part) for part in _BLOCK_RE.split(name)) + "$"
        by_group.setdefault(pattern, {})[name] = lv
    out: dict[str, dict[str, float]] = {}
    for pattern, members in by_group.items():
        if len(set(members.values())) == 1:
            out[pattern] = {"sparsity": next(iter(members.values()))}
        else:
            out.update({"^" + re.escape(n) + "$": {"sparsity": lv} for n, lv in members.items()})
    return out


# ---------------------------------------------------------------------- the transform
def sparse_ift(config: Any, sparsity: float, transform: str, *, seq_len: int | None = None) -> IFTResult:
    """Apply a Sparse-IFT transform to a causal-LM config.

    ``config``: a ``PretrainedConfig``, a dict, a ``config.json`` path or a model
    directory. Returns the transformed config (with a ``sparsity`` section giving each
    transformed tensor its iso-FLOP level and, for parallel/factorized/doped, a
    ``sparse_ift`` section describing the new layers) and the FLOP comparison.
    Nothing is allocated: both models are built on the ``meta`` device.
    """
    # Long by design: the transform step by step (widen, check, build, count), each step a few lines.
    transform = str(transform).lower()
    if transform not in TRANSFORMS:
        raise SparsityError(
            f"Unknown Sparse-IFT transform {transform!r}; use one of {', '.join(TRANSFORMS)}."
        )
    sparsity = check_level(sparsity)
    config = load_config(config)
    if getattr(config, IFT_SECTION, None):
        raise SparsityError(
            "This config is already Sparse-IFT transformed; start from the original dense config."
        )
    base = copy.deepcopy(config)
    old_section = get_sparsity_config(base)
    set_sparsity_config(base, None)
    orig_model = build_meta_model(base)
    plan = plan_sparsity(orig_model, SparsityConfig(sparsity=max(sparsity, 0.0)))
    targets = [d for d in plan if d.sparsify]
    if not targets:
        raise SparsityError(
            f"The default rule finds no projection / FFN layer in {type(orig_model).__name__}."
        )
    notes: list[str] = []
    changes: dict[str, tuple[Any, Any]] = {}

    if transform == "wide":
        new_cfg, changes = _widen_config(base, sparsity)
        # Provenance only: a wide model is the stock class, but the section marks the config as transformed.
        setattr(
            new_cfg,
            IFT_SECTION,
            {"transform": "wide", "sparsity": sparsity, "widths": {k: list(v) for k, v in changes.items()}},
        )
        new_model = build_meta_model(new_cfg)
        new_params = dict(new_model.named_parameters())
        specs = {}
        for d in targets:
            p = new_params[d.name]
            dims = (int(p.shape[d.input_dim]), int(p.shape[1 - d.input_dim]))
            lv = max(0.0, 1.0 - d.numel / p.numel())
            specs[d.name] = [(d.name, dims, lv)]
    else:
        new_cfg = copy.deepcopy(base)
        section: dict[str, Any] = {"transform": transform, "sparsity": sparsity, "modules": {}}
        specs = {}
        for d in targets:
            module = d.name.rsplit(".", 1)[0]
            d_in, d_out, _ = linear_dims(orig_model.get_submodule(module))
            spec, tensors = _module_spec(transform, sparsity, d_in, d_out)
            section["modules"][module] = spec
            specs[d.name] = [(f"{module}.{t}", shape, lv) for t, shape, lv in tensors]
        setattr(new_cfg, IFT_SECTION, section)
        new_model = build_meta_model(new_cfg)
        if transform == "parallel" and abs(1.0 / (1.0 - sparsity) - round(1.0 / (1.0 - sparsity))) > 1e-9:
            k = max(1, round(1.0 / (1.0 - sparsity)))
            notes.append(
                f"1/(1-s) = {1.0 / (1.0 - sparsity):.3f} is not an integer: {k} branches at sparsity "
                f"{1.0 - 1.0 / k:.4f} each keep the layer iso-FLOP."
            )

    levels = {
        n: lv
        for tensors in specs.values()
        for n, _, lv in tensors
        if not n.endswith(("low_rank_a", "low_rank_b"))
    }
    sparse_levels = {n: lv for n, lv in levels.items() if lv > 0}
    if sparse_levels:
        keep = {}
        if old_section is not None:
            keep = {"init_method": old_section.init_method, "seed": old_section.seed}
        section_cfg = SparsityConfig(param_name_patterns=_patterns(sparse_levels), **keep)
        set_sparsity_config(new_cfg, section_cfg)
        check = {x.name: x.sparsity for x in plan_sparsity(new_model, section_cfg) if x.sparsify}
        if check.keys() != sparse_levels.keys() or any(
            abs(check[n] - sparse_levels[n]) > 1e-12 for n in check
        ):
            raise SparsityError(
                "Internal error: the generated sparsity patterns do not select the transformed tensors."
            )
    else:
        set_sparsity_config(new_cfg, None)
        notes.append("sparsity 0: the transform is the identity on FLOPs and nothing is sparsified.")

    original = count_flops(orig_model, seq_len=seq_len)
    transformed = count_flops(new_model, levels=sparse_levels, seq_len=seq_len or original.seq_len)
    by_name = {t.name: t for t in transformed.layers if t.kind == "linear"}
    layers = []
    for d in targets:
        o = next(t for t in original.layers if t.name == d.name)
        tensors = specs[d.name]
        spent = sum(by_name[n].forward_flops_per_token(transformed.seq_len) for n, _, _ in tensors)
        layers.append(
            IFTLayer(d.name, o.shape, [(n, s, lv) for n, s, lv in tensors], o.dense_flops_per_token, spent)
        )
    return IFTResult(transform, sparsity, new_cfg, original, transformed, layers, levels, notes, changes)


def read_ift_config(path: str | os.PathLike) -> Any:
    """Load a config written by ``hf_sparsity ift`` (a folder or its ``config.json``)."""
    path = str(path)
    return load_config(
        path if os.path.isdir(path) or path.endswith(".json") else os.path.join(path, CONFIG_NAME)
    )
