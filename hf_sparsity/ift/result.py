"""What a Sparse-IFT transform gives back: per-layer figures, the FLOP comparison, saving
(:class:`IFTResult`)."""

from __future__ import annotations

import copy
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from ..flops import FlopReport
from ..mask_engine.config import SparsityConfig, get_sparsity_config
from ..modeling import meta_causal_lm
from ..utils import atomic_dir
from .models import (
    MODULE_TRANSFORMS,
    build_ift_model,
    modeling_code,
)

MODELING_FILE = "modeling_sparse_ift.py"
_BLOCK_RE = re.compile(r"\.\d+\.")


def _causal_lm_class(config: Any) -> str:
    return type(meta_causal_lm(config)).__name__


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
            f"  parameters grow by {_fmt(pd, sign=True)} "
            f"(x{whole['params']['transformed'] / whole['params']['original']:.2f}); "
            "nonzero parameters change by "
            f"{_fmt(whole['nonzero_params']['transformed'] - whole['nonzero_params']['original'], sign=True)}"
            "."
        )
        return out + [f"  note: {n}" for n in self.notes]

    # -------------------------------------------------------------- writing
    def save(self, out_dir: str | os.PathLike, overwrite: bool = False) -> str:
        """Write ``config.json`` (and ``modeling_sparse_ift.py`` when the architecture changes),
        atomically."""
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
