"""Sparse-IFT: transform a model config so each projection / FFN layer is iso-FLOP at a sparsity.

Seed ``003_*`` (Thangarasa et al., "Sparse-IFT", 2023). Given a sparsity ``s``,
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
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

from .config import SparsityConfig, check_level, get_sparsity_config, set_sparsity_config
from .constants import CONFIG_NAME
from .flops import FlopReport, build_meta_model, count_flops, load_config
from .ift_models import (
    IFT_SECTION,
    MODULE_TRANSFORMS,
    TRANSFORMS,
    build_ift_model,
    linear_dims,
    modeling_code,
)
from .targeting import plan_sparsity
from .utils import SparsityError, atomic_dir

__all__ = ["IFTLayer", "IFTResult", "TRANSFORMS", "build_ift_model", "sparse_ift", "wide_width"]

MODELING_FILE = "modeling_sparse_ift.py"
_BLOCK_RE = re.compile(r"\.\d+\.")
_FFN_KEYS = ("intermediate_size", "ffn_dim", "n_inner")


@dataclass
class IFTLayer:
    """One transformed layer: the dense original and the sparse tensors that replace it."""

    name: str  # the original weight, e.g. transformer.h.0.attn.c_attn.weight
    shape: tuple[int, int]  # (d_in, d_out) of the original
    tensors: list[tuple[str, tuple[int, int], float]]  # (parameter, (d_in, d_out), sparsity)
    original_flops: float  # forward FLOPs per token, dense original
    transformed_flops: float  # forward FLOPs per token at the tensors' levels

    @property
    def ratio(self) -> float:
        return self.transformed_flops / self.original_flops

    @property
    def group(self) -> str:
        return _BLOCK_RE.sub(".*.", self.name)


@dataclass
class IFTResult:
    """A Sparse-IFT transform: the new config, its per-layer levels and the FLOP comparison."""

    transform: str
    sparsity: float
    config: Any  # the transformed PretrainedConfig (sparsity section and, for module transforms, sparse_ift)
    original: FlopReport  # the untransformed model, dense
    transformed: FlopReport  # the transformed model at its levels
    layers: list[IFTLayer]
    levels: dict[str, float]
    notes: list[str] = field(default_factory=list)
    config_changes: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # key -> (old, new), wide only

    @property
    def sparsity_config(self) -> SparsityConfig:
        return get_sparsity_config(self.config)

    @property
    def max_layer_deviation(self) -> float:
        """Largest relative FLOP difference of any transformed layer from its original."""
        return max((abs(layer.ratio - 1.0) for layer in self.layers), default=0.0)

    def model_code(self) -> tuple[str, str] | None:
        """(class name, module source) when the architecture changes; None for ``wide``."""
        if self.transform not in MODULE_TRANSFORMS:
            return None
        return modeling_code(_causal_lm_class(self.config), self.transform)

    def build_model(self):
        """Instantiate the transformed model (random init), ready for ``SparsityCallback``."""
        return build_ift_model(self.config)

    # -------------------------------------------------------------- output
    def whole_model(self) -> dict[str, dict[str, float]]:
        """Forward FLOPs per token by kind, original (dense) vs transformed (sparse), plus params."""
        out = {}
        for kind in ("linear", "attention", "logits"):
            out[kind] = {
                "original": self.original.kind_flops_per_token(kind),
                "transformed": self.transformed.kind_flops_per_token(kind),
            }
        t_names = {t for layer in self.layers for t, _, _ in layer.tensors}
        other_o = sum(
            t.forward_flops_per_token(self.original.seq_len)
            for t in self.original.layers
            if t.kind == "linear" and t.name not in {layer.name for layer in self.layers}
        )
        other_t = sum(
            t.forward_flops_per_token(self.transformed.seq_len)
            for t in self.transformed.layers
            if t.kind == "linear" and t.name not in t_names
        )
        out["transformed_layers"] = {
            "original": sum(layer.original_flops for layer in self.layers),
            "transformed": sum(layer.transformed_flops for layer in self.layers),
        }
        out["other_linear"] = {"original": other_o, "transformed": other_t}
        out["total"] = {
            "original": self.original.forward_flops_per_token,
            "transformed": self.transformed.forward_flops_per_token,
        }
        out["training_total"] = {
            "original": self.original.training_flops_per_token,
            "transformed": self.transformed.training_flops_per_token,
        }
        out["params"] = {"original": self.original.params, "transformed": self.transformed.params}
        out["nonzero_params"] = {
            "original": self.original.nonzero_params,
            "transformed": self.transformed.nonzero_params,
        }
        return out

    def to_dict(self) -> dict[str, Any]:
        groups = _group_layers(self.layers)
        return {
            "transform": self.transform,
            "sparsity": self.sparsity,
            "seq_len": self.original.seq_len,
            "config_changes": dict(self.config_changes),
            "layers": [
                {
                    "layer": g["group"],
                    "count": g["count"],
                    "original_shape": list(g["shape"]),
                    "tensors": [{"name": n, "shape": list(s), "sparsity": lv} for n, s, lv in g["tensors"]],
                    "original_flops_per_token": g["original_flops"],
                    "transformed_flops_per_token": g["transformed_flops"],
                    "ratio": g["ratio"],
                }
                for g in groups
            ],
            "max_layer_deviation": self.max_layer_deviation,
            "whole_model": self.whole_model(),
            "notes": list(self.notes),
        }

    def format(self) -> str:
        """The table ``hf_sparsity ift`` prints."""
        cfg = self.original
        lines = [
            f"Sparse-IFT {self.transform} at sparsity {self.sparsity:g} "
            f"({self.original.model_type}, seq_len {cfg.seq_len}); forward FLOPs per token.",
        ]
        changes = dict(self.config_changes)
        if changes:
            lines.append("config: " + ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changes.items()))
        lines.append("")
        groups = _group_layers(self.layers)
        w = max([len(g["group"]) for g in groups] + [5])
        lines.append(
            f"{'layer':<{w}}  {'n':>3}  {'original':<10} {'orig FLOPs':>10} {'new FLOPs':>10} {'ratio':>7}  "
            "transformed: tensor shape@sparsity"
        )
        for g in groups:
            desc = " + ".join(f"{_short(n, g['module'])}{s[0]}x{s[1]}@{lv:.4f}" for n, s, lv in g["tensors"])
            shape = f"{g['shape'][0]}x{g['shape'][1]}"
            lines.append(
                f"{g['group']:<{w}}  {g['count']:>3}  {shape:<10} {_fmt(g['original_flops']):>10} "
                f"{_fmt(g['transformed_flops']):>10} {g['ratio']:>7.4f}  {desc}"
            )
        lines.append(
            f"iso-FLOP: the largest relative difference of a transformed layer from its original is "
            f"{self.max_layer_deviation:.1e}."
        )
        lines.append("")
        lines.append("whole model (per token)        original    transformed     change")
        whole = self.whole_model()
        labels = [
            ("transformed_layers", "transformed layers"),
            ("other_linear", "other linear layers"),
            ("attention", "attention logits+softmax"),
            ("logits", "LM head (logits)"),
            ("total", "inference FLOPs"),
            ("training_total", "training FLOPs (3x)"),
            ("params", "parameters"),
            ("nonzero_params", "nonzero parameters"),
        ]
        for key, label in labels:
            a, b = whole[key]["original"], whole[key]["transformed"]
            ch = f"{(b - a) / a:+.2%}" if a else ("+0.00%" if not b else "new")
            lines.append(f"  {label:<26} {_fmt(a):>11} {_fmt(b):>14} {ch:>10}")
        lines.append("")
        lines.extend(self.explanation())
        return "\n".join(lines)

    def explanation(self) -> list[str]:
        """Why the whole model is not exactly iso-FLOP: the untransformed terms, quantified."""
        whole = self.whole_model()
        total_o = whole["total"]["original"]
        parts = []
        for key, label in (
            ("attention", "attention logits/softmax (no weights; scales with d_model)"),
            ("logits", "LM head (kept dense; scales with d_model)"),
            ("other_linear", "untransformed linear layers"),
            ("transformed_layers", "rounding of the transformed layers"),
        ):
            d = whole[key]["transformed"] - whole[key]["original"]
            if abs(d) > 1e-9 * total_o:
                parts.append(f"{label}: {_fmt(d, sign=True)} ({d / total_o:+.2%} of the original)")
        out = ["difference explained:"]
        if parts:
            out += ["  " + p for p in parts]
        else:
            out.append("  none: only the transformed layers changed, and each is iso-FLOP.")
        out.append(
            "  embeddings are excluded from FLOPs (Chinchilla App. F); embeddings, norms and the LM head are "
            "never sparsified or transformed."
        )
        pd = whole["params"]["transformed"] - whole["params"]["original"]
        out.append(
            f"  parameters grow by {_fmt(pd, sign=True)} (x{whole['params']['transformed'] / whole['params']['original']:.2f}); "
            f"nonzero parameters change by {_fmt(whole['nonzero_params']['transformed'] - whole['nonzero_params']['original'], sign=True)}."
        )
        return out + [f"  note: {n}" for n in self.notes]

    # -------------------------------------------------------------- writing
    def save(self, out_dir: str | os.PathLike, overwrite: bool = False) -> str:
        """Write ``config.json`` (and ``modeling_sparse_ift.py`` when the architecture changes), atomically."""
        cfg = copy.deepcopy(self.config)
        code = self.model_code()
        with atomic_dir(out_dir, overwrite=overwrite) as tmp:
            if code is not None:
                cls, src = code
                cfg.auto_map = {"AutoModelForCausalLM": f"{MODELING_FILE[:-3]}.{cls}"}
                (tmp / MODELING_FILE).write_text(src, encoding="utf-8")
            cfg.save_pretrained(str(tmp))
            (tmp / "sparse_ift_report.json").write_text(
                json.dumps(self.to_dict(), indent=2), encoding="utf-8"
            )
        return str(out_dir)


# ---------------------------------------------------------------------- helpers
def _fmt(x: float, sign: bool = False) -> str:
    a = abs(x)
    for div, suf in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if a >= div:
            s = f"{x / div:.3f}{suf}"
            break
    else:
        s = f"{x:.0f}"
    return ("+" + s if x >= 0 else s) if sign else s


def _short(name: str, module: str) -> str:
    rest = name[len(module) + 1 :] if name.startswith(module + ".") else ""
    rest = rest.removesuffix("weight").rstrip(".")
    return f"{rest} " if rest else ""


def _group_layers(layers: list[IFTLayer]) -> list[dict[str, Any]]:
    groups: dict[str, dict[str, Any]] = {}
    for layer in layers:
        g = groups.get(layer.group)
        if g is None:
            module = layer.name.rsplit(".", 1)[0]
            g = groups[layer.group] = {
                "group": layer.group.removesuffix(".weight"),
                "module": module,
                "shape": layer.shape,
                "tensors": layer.tensors,
                "count": 0,
                "original_flops": 0.0,
                "transformed_flops": 0.0,
            }
        g["count"] += 1
        g["original_flops"] += layer.original_flops
        g["transformed_flops"] += layer.transformed_flops
    for g in groups.values():
        g["ratio"] = g["transformed_flops"] / g["original_flops"]
    return list(groups.values())


def _causal_lm_class(config: Any) -> str:
    from .modeling import meta_causal_lm

    return type(meta_causal_lm(config)).__name__


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
    """The layer's ``sparse_ift`` spec and its (sub-parameter, shape, level) list, iso-FLOP with d_in x d_out."""
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
    """One regex per layer group (block index folded) when all its blocks share a level, else one per tensor."""
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
