"""FLOPs and parameter accounting for dense and sparse causal LMs.

FLOPs follow Chinchilla (Hoffmann et al. 2022) Appendix F, as the seeds do
(``001_*`` footnote 1): embedding FLOPs excluded, attention logits, softmax and
the attention-weighted reduction included, final logits included, biases, norms
and non-linearities ignored; the backward pass costs twice the forward pass, so
training is 3x forward. Each linear layer is scaled by its own density
(``1 - sparsity``): a sparse GEMM is one multiply-add per nonzero weight, and the
backward pass (input and weight gradients) skips the same positions.

Per token, for a sequence of length ``L``:

* a linear layer ``d_in -> d_out`` at sparsity ``s``: ``2 * d_in * d_out * (1 - s)``;
* attention with ``h`` heads of size ``k``: ``2*L*h*k`` (logits) + ``3*h*L``
  (softmax) + ``2*L*h*k`` (reduction);
* final logits ``d -> V``: ``2 * d * V`` (dense unless explicitly targeted).

Everything is counted from the model's actual modules, so any architecture
counts right (GPT-2 Conv1D, Llama's three MLP matrices, GQA, a Sparse-IFT
model): every ``nn.Linear`` / ``Conv1D`` contributes its own shape, and a module
with weights in another form declares its matmuls through
``hf_sparsity_matmuls()`` (see :class:`hf_sparsity.ift_models.DopedLinear`). A
config-only path (:func:`count_flops_from_config`) builds the model on the
``meta`` device, which allocates nothing, so a 70B config counts in a second.

Typical use::

    report = count_flops(model, masks=engine.masks, seq_len=2048)
    report.inference_flops_per_token, report.nonzero_params
    count_flops_from_config("gpt3-xl/config.json", sparsity=0.838).summary()

and during training, :class:`FlopAccountant`.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn

from .config import SparsityConfig, get_sparsity_config
from .constants import CONFIG_NAME, SPARSITY_MASKS_NAME
from .modeling import context_length, linear_dims, meta_causal_lm
from .serialization import mask_levels
from .targeting import plan_sparsity, unwrap_model
from .utils import SparsityError

TRAINING_MULTIPLIER = 3
"""Forward + backward = 3x forward (the backward pass computes input and weight gradients)."""

logger = logging.getLogger(__name__)
_BLOCK_INDEX_RE = re.compile(r"\.\d+\.")


@dataclass
class LayerFlops:
    """One term of the FLOP count: a linear layer, one block's attention, the logits, or an embedding.

    ``dense_flops_per_token`` is the forward cost at density 1; for attention it is the
    coefficient per token of sequence length (multiply by ``seq_len``), since attention
    per token grows with the context.
    """

    name: str
    kind: str  # linear | attention | logits | embedding
    shape: tuple[int, ...] = ()
    params: int = 0
    nonzero_params: int = 0
    sparsity: float = 0.0
    dense_flops_per_token: float = 0.0

    def forward_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token of this term at its sparsity."""
        if self.kind == "attention":
            return self.dense_flops_per_token * seq_len
        if self.kind == "embedding":
            return 0.0  # excluded, as in the seeds
        return self.dense_flops_per_token * (1.0 - self.sparsity)

    def dense_forward_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token of this term if it were dense."""
        if self.kind in ("attention", "embedding"):
            return self.forward_flops_per_token(seq_len)
        return self.dense_flops_per_token

    @property
    def group(self) -> str:
        """The name with the block index replaced by ``*``: identical layers of every block share it."""
        return _BLOCK_INDEX_RE.sub(".*.", self.name)


@dataclass
class FlopReport:
    """FLOPs and parameters of one model at one set of per-layer sparsity levels.

    ``params`` counts every unique parameter (tied weights once, embeddings and
    biases included); ``nonzero_params`` subtracts the masked weights.
    """

    layers: list[LayerFlops]
    seq_len: int
    params: int
    nonzero_params: int
    model_type: str = ""
    notes: list[str] = field(default_factory=list)

    # -------------------------------------------------------------- totals
    @property
    def forward_flops_per_token(self) -> float:
        return sum(t.forward_flops_per_token(self.seq_len) for t in self.layers)

    @property
    def inference_flops_per_token(self) -> float:
        """Forward FLOPs per token, averaged over a full sequence of ``seq_len`` (Chinchilla's convention)."""
        return self.forward_flops_per_token

    @property
    def training_flops_per_token(self) -> float:
        return TRAINING_MULTIPLIER * self.forward_flops_per_token

    @property
    def forward_flops_per_sequence(self) -> float:
        return self.forward_flops_per_token * self.seq_len

    @property
    def training_flops_per_sequence(self) -> float:
        return self.training_flops_per_token * self.seq_len

    @property
    def embedding_flops_per_token(self) -> float:
        """Chinchilla's embedding term (2 * V * d per token): reported, never added to the totals."""
        return sum(t.dense_flops_per_token for t in self.layers if t.kind == "embedding")

    def kind_flops_per_token(self, kind: str) -> float:
        return sum(t.forward_flops_per_token(self.seq_len) for t in self.layers if t.kind == kind)

    # -------------------------------------------------------------- variants
    def dense(self) -> FlopReport:
        """The same model with every layer dense."""
        layers = [replace(t, sparsity=0.0, nonzero_params=t.params) for t in self.layers]
        return FlopReport(layers, self.seq_len, self.params, self.params, self.model_type, list(self.notes))

    def with_seq_len(self, seq_len: int) -> FlopReport:
        return replace(self, seq_len=int(seq_len))

    @property
    def sparsity_levels(self) -> dict[str, float]:
        """Per-layer level of every sparse term (name -> sparsity)."""
        return {t.name: t.sparsity for t in self.layers if t.sparsity > 0}

    # -------------------------------------------------------------- output
    def summary(self) -> dict[str, Any]:
        """The headline numbers, as ``hf_sparsity flops --json`` prints them."""
        return {
            "params": int(self.params),
            "nonzero_params": int(self.nonzero_params),
            "inference_flops_per_token": self.inference_flops_per_token,
            "training_flops_per_token": self.training_flops_per_token,
            "inference_flops_per_sequence": self.forward_flops_per_sequence,
            "training_flops_per_sequence": self.training_flops_per_sequence,
            "seq_len": int(self.seq_len),
        }

    def to_dict(self) -> dict[str, Any]:
        d = self.summary()
        d["model_type"] = self.model_type
        d["layers"] = [dict(asdict(t), shape=list(t.shape)) for t in self.layers]
        return d

    def grouped(self) -> list[dict[str, Any]]:
        """Rows per layer group (block index folded): count, params, forward FLOPs per token."""
        rows: dict[str, dict[str, Any]] = {}
        for t in self.layers:
            r = rows.setdefault(
                t.group,
                {"group": t.group, "kind": t.kind, "shape": t.shape, "count": 0, "params": 0,
                 "nonzero_params": 0, "flops_per_token": 0.0, "levels": set()},
            )  # fmt: skip
            r["count"] += 1
            r["params"] += t.params
            r["nonzero_params"] += t.nonzero_params
            r["flops_per_token"] += t.forward_flops_per_token(self.seq_len)
            r["levels"].add(round(t.sparsity, 4))
        for r in rows.values():
            levels = sorted(r.pop("levels"))
            r["sparsity"] = levels[0] if len(levels) == 1 else (levels[0], levels[-1])
        return list(rows.values())


# ---------------------------------------------------------------------- counting
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
    """Forward attention FLOPs per token per unit of sequence length (Chinchilla F: logits, softmax, reduce)."""
    return 2 * heads * head_dim + 3 * heads + 2 * heads * head_dim


def _levels_from_masks(masks: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    """name -> (numel, zeros)."""
    out = {}
    for name, m in masks.items():
        n = m.numel()
        out[name] = (n, n - int(m.sum(dtype=torch.int64)))
    return out


def _zeros(level: float, numel: int) -> int:
    return int(round(level * numel))  # the seeds' per-tensor rule (masks.num_zeros)


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
    model = unwrap_model(model)
    config = getattr(model, "config", None)
    seq_len = int(seq_len or context_length(config))
    if seq_len <= 0:
        raise SparsityError(f"`seq_len` must be a positive integer, got {seq_len}.")

    zeros_by_name: dict[str, tuple[int, int]] = {}
    if masks is not None:
        zeros_by_name = _levels_from_masks(masks)
    elif levels is not None:
        shapes = {n: p.numel() for n, p in model.named_parameters()}
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
            v, d = (int(x) for x in w.shape)
            wname = param_names.get(id(w), prefix + "weight")
            zeros, level = level_of(wname)
            n = 0 if id(w) in seen else v * d
            # Chinchilla's embedding term (2*V*d per token) belongs to token embeddings only; the seeds
            # exclude it from the totals, so it is informational.
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


# ---------------------------------------------------------------------- config-only path
def load_config(source: Any):
    """A ``PretrainedConfig`` from a config object, a dict, a ``config.json`` path or a model directory."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(source, PretrainedConfig):
        return source
    if isinstance(source, Mapping):
        data = dict(source)
    else:
        path = str(source)
        if os.path.isdir(path):
            path = os.path.join(path, CONFIG_NAME)
        if not os.path.isfile(path):
            raise SparsityError(
                f"No config at {str(source)!r}. Give a config.json path or a model directory."
            )
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except json.JSONDecodeError as e:
            raise SparsityError(f"{path!r} is not valid JSON ({e}).") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise SparsityError(
            f'The config {str(source)[:200]!r} has no `model_type`; it needs one (e.g. "gpt2", "llama") '
            "so the architecture can be built."
        )
    data = dict(data)
    model_type = data.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **data)
    except ValueError as e:
        raise SparsityError(f"Unknown model_type {model_type!r} ({e}).") from None


def build_meta_model(config: Any) -> nn.Module:
    """Instantiate the causal LM of ``config`` (a config, folder or dict) on the ``meta`` device.

    A Sparse-IFT config (one with a ``sparse_ift`` section) builds its transformed architecture.
    """
    config = load_config(config)
    if getattr(config, "sparse_ift", None):
        from .ift_models import build_ift_model

        return meta_causal_lm(config, build_ift_model)
    return meta_causal_lm(config)


def mask_levels_from_file(path: str | os.PathLike) -> dict[str, float]:
    """Per-tensor levels recorded in a ``sparsity_masks.safetensors`` (metadata only; nothing unpacked)."""
    return mask_levels(path)


def count_flops_from_config(
    config: Any,
    sparsity: float | SparsityConfig | dict | Mapping[str, float] | None = None,
    *,
    seq_len: int | None = None,
    use_masks: bool = True,
) -> FlopReport:
    """FLOPs and parameters from a config alone (a path, a model directory, a dict or a ``PretrainedConfig``).

    The model is built on the ``meta`` device, so this works for models far too large
    to instantiate. ``sparsity``: a level or a :class:`SparsityConfig` (planned with the
    targeting rules), or a mapping of parameter name -> level. With ``None``: the masks
    file of a model directory (when ``use_masks``), else the config's own sparsity
    section, else dense.
    """
    model = build_meta_model(config)
    if sparsity is None:
        if use_masks and isinstance(config, (str, os.PathLike)) and os.path.isdir(config):
            if os.path.isfile(os.path.join(config, SPARSITY_MASKS_NAME)):
                return count_flops(model, levels=mask_levels_from_file(config), seq_len=seq_len)
        section = get_sparsity_config(model.config)
        return count_flops(model, sparsity=section, seq_len=seq_len)
    if isinstance(sparsity, Mapping) and not _is_section(sparsity):
        return count_flops(model, levels=sparsity, seq_len=seq_len)
    return count_flops(model, sparsity=sparsity, seq_len=seq_len)


def _is_section(d: Mapping) -> bool:
    keys = {"sparsity", "param_name_patterns", "param_filter", "groups", "init_method", "seed", "algorithm"}
    return bool(set(d) & keys)


# ---------------------------------------------------------------------- the formula itself
def chinchilla_forward_flops(
    *,
    seq_len: int,
    vocab_size: int,
    d_model: int,
    num_layers: int,
    ffw_size: int,
    num_heads: int,
    key_size: int | None = None,
    sparsity: float = 0.0,
    include_embeddings: bool = False,
) -> dict[str, float]:
    """Chinchilla Appendix F, term by term, forward FLOPs per sequence (a GPT-style block, 2-matrix MLP).

    ``sparsity`` scales the projection and feed-forward terms (QKV, attention output,
    both MLP matrices), as in the seeds; attention logits, softmax and final logits
    stay dense. This closed form is the reference the module-based count is tested against.
    """
    key_size = key_size or d_model // num_heads
    dens = 1.0 - sparsity
    hk = key_size * num_heads
    terms = {
        "embeddings": 2.0 * seq_len * vocab_size * d_model,
        "qkv": 2.0 * 3 * seq_len * d_model * hk * dens,
        "logits_qk": 2.0 * seq_len * seq_len * hk,
        "softmax": 3.0 * num_heads * seq_len * seq_len,
        "reduction": 2.0 * seq_len * seq_len * hk,
        "attn_out": 2.0 * seq_len * hk * d_model * dens,
        "ffw": 2.0 * seq_len * (d_model * ffw_size + d_model * ffw_size) * dens,
        "final_logits": 2.0 * seq_len * d_model * vocab_size,
    }
    per_layer = sum(terms[k] for k in ("qkv", "logits_qk", "softmax", "reduction", "attn_out", "ffw"))
    total = (
        num_layers * per_layer + terms["final_logits"] + (terms["embeddings"] if include_embeddings else 0.0)
    )
    terms["per_layer"] = per_layer
    terms["forward"] = total
    terms["training"] = TRAINING_MULTIPLIER * total
    return terms


# ---------------------------------------------------------------------- training-time accounting
class FlopAccountant:
    """Cumulative training FLOPs of a run whose sparsity changes, and the dense-equivalent FLOPs.

    Trainer-independent; the sparsity callback (or any loop) calls it once per
    optimizer step, or per logging interval, with the tokens processed and the
    current per-tensor levels::

        acc = FlopAccountant(model, targets=engine.targets, seq_len=block_size)
        ...
        acc.add_tokens(n_tokens, engine.levels)   # levels: name -> sparsity; absent names count dense
        logs.update(acc.log_dict())               # flops/train, flops/dense_equivalent, ...
        state = acc.state_dict(); acc.load_state_dict(state)   # carry across resume

    After a densify event pass ``{}`` (or the levels left): every tensor not named is
    dense. Reported:

    * ``training_flops``: 3x forward FLOPs actually needed at the levels in force;
    * ``dense_training_flops``: the same tokens trained fully dense;
    * ``effective_sparsity``: the FLOP-weighted average level of the sparsifiable
      layers, ``1 - spent / dense`` over those layers only. This is the "effective
      75%" of Variable SPDF (seed ``004_*``): 90% sparse for 5/6 of the tokens and
      dense for the rest gives 0.75;
    * ``flop_reduction``: ``dense_training_flops / training_flops`` for the whole model
      (attention and logits included, so it stays below ``1 / (1 - effective)``).

    ``targets`` names the sparsifiable tensors (default: every tensor ever given a
    level); their dense FLOPs form the denominator of ``effective_sparsity``.
    """

    def __init__(
        self,
        model: nn.Module | FlopReport,
        *,
        targets: Iterable[str] | None = None,
        seq_len: int | None = None,
    ):
        report = model if isinstance(model, FlopReport) else count_flops(model, seq_len=seq_len)
        if seq_len is not None:
            report = report.with_seq_len(seq_len)
        self.seq_len = report.seq_len
        self._linear: dict[str, float] = {}  # name -> dense forward FLOPs per token
        self._fixed = 0.0  # forward FLOPs per token that sparsity never changes (attention, logits)
        for t in report.layers:
            if t.kind == "linear":
                self._linear[t.name] = self._linear.get(t.name, 0.0) + t.dense_flops_per_token
            elif t.kind in ("attention", "logits"):
                self._fixed += t.dense_forward_flops_per_token(self.seq_len)
            # embeddings: excluded from FLOPs, as in the seeds
        self._dense_forward = self._fixed + sum(self._linear.values())
        self._ignored: set[str] = set()
        self.targets: set[str] = self._known(targets or ())
        self.tokens = 0
        self.training_flops = 0.0
        self.dense_training_flops = 0.0
        self.target_flops = 0.0  # spent in the sparsifiable layers
        self.dense_target_flops = 0.0

    def forward_flops_per_token(self, levels: Mapping[str, float] | None = None) -> float:
        """Forward FLOPs per token at ``levels`` (name -> sparsity; absent names dense)."""
        levels = levels or {}
        known = self._known(levels)
        return self._dense_forward - sum(self._linear[n] * float(levels[n]) for n in known)

    def _known(self, names: Iterable[str]) -> set[str]:
        """The names that are linear layers; others (a sparse embedding, say) have no counted FLOPs.

        Called on every step by a training loop, so unknown names warn once instead of raising.
        """
        names = set(names)
        unknown = names - set(self._linear) - self._ignored
        if unknown:
            logger.warning(
                "FLOP accounting ignores sparsity of %d tensor(s) that are not linear layers (e.g. %s): "
                "their FLOPs are not counted (embeddings) or not adjustable.",
                len(unknown),
                sorted(unknown)[0],
            )
            self._ignored |= unknown
        return names & set(self._linear)

    def add_tokens(self, n_tokens: int, levels: Mapping[str, float] | None = None) -> float:
        """Account ``n_tokens`` trained at ``levels``; returns the training FLOPs they cost."""
        if n_tokens < 0:
            raise SparsityError(f"n_tokens must be >= 0, got {n_tokens}.")
        levels = dict(levels or {})
        self.targets.update(self._known(levels))
        fwd = self.forward_flops_per_token(levels)
        spent = TRAINING_MULTIPLIER * fwd * n_tokens
        self.tokens += int(n_tokens)
        self.training_flops += spent
        self.dense_training_flops += TRAINING_MULTIPLIER * self._dense_forward * n_tokens
        tgt_dense = sum(self._linear[n] for n in self.targets)
        tgt_spent = sum(self._linear[n] * (1.0 - float(levels.get(n, 0.0))) for n in self.targets)
        self.dense_target_flops += TRAINING_MULTIPLIER * tgt_dense * n_tokens
        self.target_flops += TRAINING_MULTIPLIER * tgt_spent * n_tokens
        return spent

    @property
    def effective_sparsity(self) -> float:
        if self.dense_target_flops <= 0:
            return 0.0
        return 1.0 - self.target_flops / self.dense_target_flops

    @property
    def flop_reduction(self) -> float:
        return self.dense_training_flops / self.training_flops if self.training_flops else 1.0

    @property
    def flop_savings(self) -> float:
        """Fraction of the dense-equivalent training FLOPs not spent (whole model)."""
        return 1.0 - self.training_flops / self.dense_training_flops if self.dense_training_flops else 0.0

    def log_dict(self, prefix: str = "sparsity/") -> dict[str, float]:
        """Scalars for a logger (TensorBoard, ``Trainer.log``)."""
        return {
            f"{prefix}train_flops": self.training_flops,
            f"{prefix}dense_equivalent_flops": self.dense_training_flops,
            f"{prefix}effective_sparsity": self.effective_sparsity,
            f"{prefix}flop_reduction": self.flop_reduction,
            f"{prefix}tokens": float(self.tokens),
        }

    def state_dict(self) -> dict[str, Any]:
        """JSON-simple state, to carry in a checkpoint."""
        return {
            "tokens": self.tokens,
            "training_flops": self.training_flops,
            "dense_training_flops": self.dense_training_flops,
            "target_flops": self.target_flops,
            "dense_target_flops": self.dense_target_flops,
            "targets": sorted(self.targets),
            "seq_len": self.seq_len,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.tokens = int(state.get("tokens", 0))
        for key in ("training_flops", "dense_training_flops", "target_flops", "dense_target_flops"):
            setattr(self, key, float(state.get(key, 0.0)))
        self.targets.update(n for n in state.get("targets", ()) if n in self._linear)
