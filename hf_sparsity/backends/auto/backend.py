""":class:`AutoBackend`, the ``auto`` layer, and whole-model planning: the LM head, then greedy decoding
of the converted model timed against the model as it was (step 7 of :mod:`hf_sparsity.backends.auto`)."""

from __future__ import annotations

import functools
import logging
import statistics
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...modeling import replace_module
from .. import cusparselt, measure
from ..base import BackendCapabilities, LayerTarget, ModelPlan, SparseBackend, Wrap, _new_counters
from ..formats import SMALL_BATCH
from ..registry import register_backend
from .cache import PlanCache
from .cost import DTYPES, PLAN_KEYS, _build, _product_input
from .planner import plan_layers

logger = logging.getLogger("hf_sparsity.backends.auto")


@register_backend
class AutoBackend(SparseBackend):
    """Wraps the backend chosen for one layer (decode) and how prefill runs; see the module docstring.

    Options (for :meth:`from_dense` and ``sparsify_for_inference(model, "auto", ...)``):
    ``formats`` (candidates, default all that apply), ``values`` (None or ``"int8"``), ``prefill_batch``
    (128), ``rounds`` (7), ``sample_layers`` (8), ``stream_bytes`` (64 MiB), ``margin`` (-0.03),
    ``model_tolerance`` (3.0), ``plan_cache`` (True), ``keep_dense_for_prefill`` (False), ``threads``;
    for a whole model also ``lm_head`` (True: time the float LM head on the native GEMV against dense),
    ``head`` (``"int8"``: the LM head is left to ``sparsify_for_inference``, which stores it as int8) and
    ``check`` (True).
    """

    name = "auto"
    capabilities = BackendCapabilities(
        devices=("cpu",),
        dtypes=DTYPES,
        training=False,
        int8_values=True,
        frees_dense=True,
        description="per layer the fastest of dense, native_dense, bitmask, nm24, csr (measured); never "
        "slower",
    )

    def __init__(self, weight: torch.Tensor, mask: torch.Tensor, **options: Any):
        options = {k: v for k, v in options.items() if k not in ("lm_head", "check", "head")}
        b, prefill, keep, choice = plan_layers({"layer": (weight, mask)}, **options)["layer"]
        if b is None:  # dense won: F.linear on the masked weight
            b = _build("dense", weight, mask, options.get("threads"))
        self._adopt((b, prefill, keep, choice))

    @classmethod
    def from_plan(
        cls, decode: SparseBackend, prefill: str | tuple[str, str], prefill_weight, choice: dict
    ) -> AutoBackend:
        """An ``auto`` layer from one entry of :func:`plan_layers`: the decode backend, the prefill modes
        (up to and above ``prefill_split`` rows), a kept dense weight for prefill (or None), the choice."""
        self = cls.__new__(cls)
        self._adopt((decode, prefill, prefill_weight, choice))
        return self

    @classmethod
    def plan_model(cls, model: Any, targets: list[LayerTarget], wrap: Wrap, **options: Any) -> ModelPlan:
        """Plan every target layer (module docstring), the LM head (``lm_head=False`` skips it), then check
        the whole model's decoding against the dense model it would otherwise be: the model as it was, with
        ``values="int8"`` every layer on the int8 dense GEMV (``check=False`` skips it). A model on a
        CUDA device is planned by :func:`hf_sparsity.backends.cusparselt.plan_cuda` instead: dense against
        ``cusparselt`` for 2:4 layers, per layer group, for decoding and for prefill."""
        # head="int8": sparsify_for_inference converts the LM head itself (int8 codes, every backend)
        int8_head = options.pop("head", None) == "int8"
        lm_head = options.pop("lm_head", True) and not int8_head
        check = options.pop("check", True)
        if cusparselt.runs_on_cuda(targets):  # dense against cuSPARSELt 2:4, per layer group
            if "prefill_batch" in options:
                options["prefill_tokens"] = options.pop("prefill_batch")
            return cusparselt.plan_cuda(targets, wrap, **options)
        head = _plan_lm_head(model, {t.module_name for t in targets}, options, wrap) if lm_head else None
        swaps, choices = _planned(targets, wrap, options, head)
        if check and swaps:
            base = None
            if options.get("values") == "int8":  # the dense model of int8 values: the int8 dense GEMV
                base = functools.cache(
                    lambda: _planned(targets, wrap, {**options, "formats": ("native_dense",)}, head)
                )
            swaps = _check_whole_model(
                model, swaps, choices, plan_cache=options.get("plan_cache", True), base=base
            )
        return ModelPlan(swaps, choices)

    def _adopt(self, parts) -> None:
        self.decode, modes, self.prefill_weight, self.choice = parts
        # prefill up to prefill_split rows, and above: "own" (the format's batched path), "unpack", "dense"
        self.prefill, self.prefill_large = (modes, modes) if isinstance(modes, str) else modes
        self.prefill_split = self.choice.get("prefill_split", 256)
        d = self.decode
        self.out_features, self.in_features = d.out_features, d.in_features
        self.nnz = d.nnz
        self.options = {}
        self.counters = _new_counters()
        self.dtype = d.dtype if hasattr(d, "dtype") else d.weight.dtype
        self.kernel = self.choice["decode"]

    @property
    def weight(self) -> torch.Tensor:
        return self.to_dense()

    @property
    def mask(self) -> torch.Tensor:
        d = self.decode
        return d.mask if hasattr(d, "_tensors") else (self.to_dense() != 0).to(torch.uint8)

    @property
    def storage_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.storage_tensors())

    def storage_tensors(self) -> list[torch.Tensor]:
        kept = [self.prefill_weight] if self.prefill_weight is not None else []
        return self.decode.storage_tensors() + kept

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // max(self.in_features, 1)
        mode = self.prefill if rows <= self.prefill_split else self.prefill_large
        if rows <= SMALL_BATCH or mode == "own":
            return self.decode.linear(x, bias)
        if mode == "dense" and self.prefill_weight is not None:
            w = self.prefill_weight
        elif hasattr(self.decode, "dense_for_matmul") and not (torch.is_grad_enabled() and x.requires_grad):
            w = self.decode.dense_for_matmul()  # unpacked into a reused buffer (or a custom op, compiled)
        else:
            w = self.decode.to_dense()
        return F.linear(_product_input(self.decode, x), w.to(x.dtype), bias)  # int8 activations too

    __call__ = linear

    def decode_call(self):
        return self.decode.decode_call()

    def _forward(self, x2d: torch.Tensor) -> torch.Tensor:
        return self.linear(x2d)

    def to_dense(self) -> torch.Tensor:
        return self.decode.to_dense().to(self.dtype)

    def extra_repr(self) -> str:
        c = self.choice
        return f"{super().extra_repr()}, decode={c['decode']}, prefill={c['prefill']}"


def _plan_lm_head(model: nn.Module, taken: set[str], options: dict, wrap: Wrap) -> tuple | None:
    """``(module name, replacement or None, choice)`` for the output embedding: dense vs native GEMV."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear) or head.weight.device.type != "cpu":
        return None
    if head.weight.dtype not in DTYPES:
        return None
    name = next((n for n, m in model.named_modules() if m is head), None)
    if name is None or name in taken:
        return None
    w = head.weight.detach()
    keys = ("rounds", "margin", "threads", "prefill_batch", "plan_cache", "model_tolerance")
    opts = {k: v for k, v in options.items() if k in keys}
    plan = plan_layers(
        {name: (w, torch.ones((), dtype=torch.uint8).expand(w.shape))}, formats=("native_dense",), **opts
    )
    b, prefill, keep, choice = plan[name]
    choice = dict(choice, lm_head=True)
    if b is None:
        return name, None, choice
    return name, wrap(head, AutoBackend.from_plan(b, prefill, keep, choice), keep_dense=True), choice


def _planned(targets: list[LayerTarget], wrap: Wrap, options: dict, head: tuple | None) -> tuple:
    """``(swaps, choices)``: every target layer as :func:`plan_layers` plans it with ``options``, then the LM
    head (``head``: :func:`_plan_lm_head`'s, or None). With ``formats=("native_dense",)`` this is the
    model's dense alternative the whole-model check compares with (int8 values: the int8 dense GEMV)."""
    plan = plan_layers({t.name: (t.weight, t.mask) for t in targets}, **options)
    swaps: list[tuple[str, nn.Module]] = []
    choices: dict[str, dict] = {}
    for t in targets:
        b, prefill, keep, choice = plan[t.name]
        choices[t.module_name] = choice
        if b is not None:
            swaps.append((t.module_name, wrap(t.module, AutoBackend.from_plan(b, prefill, keep, choice))))
    if head is not None:
        choices[head[0]] = head[2]
        if head[1] is not None:
            swaps.append((head[0], head[1]))
    return swaps, choices


def _predicted_ratio(choices: dict, dense_tok_s: float, dense: str = "dense") -> float:
    """The converted model's decoding speed against dense that the layer measurements predict: the dense
    token time, less the converted layers' dense times (``dense``: the format the baseline runs them on),
    plus their chosen formats' times."""
    token_ms = 1e3 / dense_tok_s
    saved = 0.0
    for c in choices.values():
        ms = c.get("decode_ms") or {}
        per = max(1, c.get("measured_on", 1) * c.get("timed_copies", 1))
        if c.get("decode") in ms and dense in ms:
            saved += (ms[dense] - ms[c["decode"]]) / per
    return token_ms / max(token_ms - saved, 1e-6)


CHECK_TIMING = "greedy_decode, median of round ratios"
"""How the whole-model check times decoding (part of its cached verdict's key: a verdict timed another way
is not reused)."""

INT8_GEMV_MARGIN = 1.05
"""With int8 values the whole-model check keeps a plan over the int8 dense GEMV only when the plan decodes at
least this much faster: the GEMV reads its bytes at the memory's rate on every build, while on AVX2 a 50%
bitmask plan that the check (then timing ``generate``) measured 1.00-1.03x the GEMV model decoded
SmolLM2-135M at 0.85x of it in ``hf_sparsity generate`` (`docs/results/decode_user_smollm2.md`): a near tie
goes to the GEMV."""


def _check_whole_model(
    model: nn.Module,
    swaps: list,
    choices: dict,
    rounds: int = 8,
    tokens: int = 32,
    plan_cache=True,
    base=None,
) -> list:
    """The per-layer plan checked on the whole model: greedy decoding as ``hf_sparsity generate`` runs it
    (the native step where it runs the model), ``tokens`` tokens with the swaps and then with the dense model
    it would otherwise be, ``rounds`` times in turn; the ratio is the median of the rounds' ratios (adjacent
    timings share the machine's speed of the moment, where the fastest round of each would compare moments
    apart). That dense model is the model as it was, or ``base()`` (``(swaps, choices)`` of :func:`_planned`,
    built only when timed or kept: with int8 values every layer on the int8 dense GEMV; a plan without a
    sparse format is that model already and is not timed). If the converted model is slower (with int8
    values: not :data:`INT8_GEMV_MARGIN` faster), every layer is that dense model's (recorded as
    ``whole_model_check`` in every choice). A slower verdict the layer measurements contradict (they
    predict 10% or more gained) is measured again, with more rounds, before it counts. The verdict is
    cached with the plan."""
    if not hasattr(model, "generate") or not getattr(getattr(model, "config", None), "vocab_size", None):
        return swaps
    against = "native_dense" if base else "dense"
    if base and all(c.get("decode") in ("dense", "native_dense") for c in choices.values()):
        return swaps  # the plan is its own dense model: nothing to check
    dense_model = base or (lambda: ([], {}))
    cache = PlanCache(plan_cache)
    signature = sorted(
        (name, c.get("decode"), c.get("prefill"), c.get("group")) for name, c in choices.items()
    )
    keep_at = INT8_GEMV_MARGIN if base else 1.0
    ckey = cache.key(
        "model", type(model).__name__, model.config.vocab_size, signature, against, keep_at, CHECK_TIMING
    )
    verdict = cache.get(ckey)
    if verdict is None:
        ratio, dense_tok_s = _time_whole_model(model, swaps, rounds, tokens, dense_model()[0])
        predicted = _predicted_ratio(choices, dense_tok_s, against)
        again = ratio < keep_at and predicted >= 1.1
        if again:
            ratio, dense_tok_s = _time_whole_model(model, swaps, rounds + 2, tokens, dense_model()[0])
        verdict = {
            "auto_vs_dense": round(ratio, 3),
            "against": against,
            "kept": ratio >= keep_at,
            "predicted": round(predicted, 3),
            "remeasured": again,
            "tokens": tokens,
            "rounds": rounds,
        }
        cache.put(ckey, verdict)
        cache.save()
    else:
        verdict = dict(verdict, cached=True)
    for c in choices.values():
        c["whole_model_check"] = dict(verdict)
    if verdict["kept"]:
        return swaps
    logger.warning(
        "auto: the converted model decoded at %.2fx its dense model (%s) in the whole-model check; keeping "
        "every layer on it.",
        verdict["auto_vs_dense"], "the int8 dense GEMV" if base else "as it was",
    )  # fmt: skip
    base_swaps, base_choices = dense_model()
    for name, c in choices.items():
        c["planned"] = {k: c[k] for k in PLAN_KEYS}  # (the int8 LM head's choice joins after this check)
        fallback = base_choices.get(name)
        c.update({k: fallback[k] for k in PLAN_KEYS} if fallback else zip(PLAN_KEYS, ("dense", 1.0) * 3))
    return base_swaps


def _time_whole_model(
    model: nn.Module, swaps: list, rounds: int, tokens: int, base=()
) -> tuple[float, float]:
    """``(converted / dense tok/s, dense tok/s)``: the median over ``rounds`` of each round's ratio (the two
    timed one after the other), and the median dense tok/s; the dense model is ``base``'s swaps on the model
    as it was (none: the model as it was)."""
    originals = {name: model.get_submodule(name) for name, _ in (*swaps, *base)}
    ids = torch.randint(2, int(model.config.vocab_size), (1, 8), generator=torch.Generator().manual_seed(0))
    speeds: dict[str, list[float]] = {"dense": [], "auto": []}

    def put(modules: list) -> None:
        for name, old in originals.items():
            replace_module(model, name, old)
        for name, new in modules:
            replace_module(model, name, new)

    was_training = model.training
    model.eval()
    try:
        for modules in (base, swaps):
            put(modules)
            measure.step_tok_s(model, ids, 2)
        for _ in range(rounds):
            for key, modules in (("dense", base), ("auto", swaps)):
                put(modules)
                speeds[key].append(measure.step_tok_s(model, ids, tokens))
    finally:
        put([])
        model.train(was_training)
    ratios = [a / d for a, d in zip(speeds["auto"], speeds["dense"])]
    return statistics.median(ratios), statistics.median(speeds["dense"])
