"""``auto``: per layer, the fastest of dense and each sparse format on this machine; never slower than dense.

Decoding (batch 1) and prefill (``prefill_batch`` rows, default 128, and four times as many) are decided
separately, with the current thread count:

1. **Groups.** Layers of one shape, dtype, density (to 0.05) and 2:4-ness compute alike: one decision per
   group, measured on up to ``sample_layers`` of its layers.
2. **Cost model.** Each candidate format (``dense`` = ``F.linear``, ``native_dense``, ``bitmask``,
   ``nm24`` for 2:4 masks, ``csr``; with ``values="int8"`` the sparse formats store int8 values and
   ``csr``, which has none, is left out) reads a known number of bytes per decoding call: values, indices,
   row offsets, scales (:func:`decode_bytes`). Decoding is memory-bound, so the model's time is those
   bytes over the machine's read bandwidth (:func:`~hf_sparsity.backends.measure.read_bandwidth_gbs`),
   plus a fixed cost per call (:data:`CALL_MS`).
3. **Measurement.** Every candidate runs one pass over the sample, copied until the pass streams
   ``stream_bytes`` (64 MiB) of dense weights, so that weights come from memory as in a decoding step
   rather than from the caches; the candidates are timed round-robin for ``rounds`` rounds and the
   fastest round counts (other work on the machine only ever adds time).
4. **Sanity.** A candidate that measures more than ``model_tolerance`` (default 3x) faster against
   dense than the cost model allows (a gain no byte count explains: a disturbed dense timing) is
   measured again, and every candidate keeps the faster of its two measurements (other work only adds
   time); if it still disagrees, the measurement is rejected and the format is not chosen for the group
   (``choice["rejected"]``). Slower than modeled is believed: falling back to dense is safe.
5. **Decision.** The fastest sparse format, unless it is slower than the fastest dense variant by more
   than ``-margin`` (``margin=-0.03``: 3% slower is a tie, which goes to the format holding fewer bytes);
   a positive ``margin`` asks a sparse format to win by that much.
6. **Prefill.** For the chosen format, its own batched path (from 17 rows the blocked sparse kernel) and
   "unpack" (rebuild the dense weight, one GEMM) are timed against dense at ``prefill_batch`` rows and at
   four times as many; the faster (its own kernel only when faster by :data:`PREFILL_TIE`, 5%) runs
   batches up to twice ``prefill_batch`` (``prefill``) and above (``prefill_large``). With
   ``keep_dense_for_prefill=True`` a regime where both lose to dense keeps the dense weight for it (more
   memory).
7. **Whole model** (:meth:`AutoBackend.plan_model`): the LM head gets the native GEMV when that is
   faster; then greedy decoding of the converted model is timed against the model as it was,
   interleaved. A converted model that decodes slower than before is not kept: every layer stays dense.
   A verdict that contradicts the layer measurements (they predict a clear gain) is measured again first.
8. **Plan cache.** Each group's decision and the whole-model verdict are stored per CPU model, thread
   count, layer group and options in a JSON file (``$HF_SPARSITY_PLAN_CACHE``, default
   ``plans.json`` next to the compiled kernels) and reused: a later conversion on the same machine
   measures nothing and makes the same plan. ``plan_cache=False`` neither reads nor writes it,
   ``plan_cache="refresh"`` measures again and overwrites.

The choice per layer, with every measured and modeled time, is in :attr:`AutoBackend.choice`; for a
whole model, :func:`hf_sparsity.inference.auto_report` prints the per-layer table.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import statistics
import tempfile
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..modeling import replace_module
from ..utils import SparsityError
from . import _native, measure
from .base import BackendCapabilities, LayerTarget, ModelPlan, SparseBackend, Wrap, _new_counters, check_nm
from .formats import SMALL_BATCH
from .measure import interleaved_ms
from .registry import get_backend, register_backend

logger = logging.getLogger(__name__)

CANDIDATES = ("dense", "native_dense", "bitmask", "nm24", "csr")
DENSE = ("dense", "native_dense")
PLAN_KEYS = (
    "decode", "decode_vs_dense", "prefill", "prefill_vs_dense", "prefill_large", "prefill_large_vs_dense",
)  # fmt: skip
"""What ``auto`` decided for a layer, in each choice dict: decode format, prefill mode up to twice
``prefill_batch`` rows and above, each with its speed against dense."""
CALL_MS = 0.004
"""The cost model's fixed time per product call (Python and kernel launch), in milliseconds: small layers
cost their calls more than their bytes."""
PLAN_VERSION = 4
"""Bumped when a cached plan would no longer mean the same (kernels, cost model, decision rules)."""


def _is_24(mask: torch.Tensor) -> bool:
    try:
        check_nm(mask, 2, 4)
        return True
    except SparsityError:
        return False


def _build(
    fmt: str, w: torch.Tensor, m: torch.Tensor, threads: int | None, values: str | None = None
) -> SparseBackend:
    if fmt == "dense":
        return get_backend("native_dense").from_dense(w, m, kernel="torch")
    if fmt == "native_dense":
        return get_backend(fmt).from_dense(w, m, threads=threads)
    if fmt == "csr":
        b = get_backend("csr").from_dense(w, m, kernel="native", threads=threads)
        b.release_dense()  # auto never trains or refreshes a layer
        return b
    return get_backend(fmt).from_dense(w, m, prefill="native", threads=threads, values=values)


def decode_bytes(fmt: str, out_f: int, in_f: int, nnz: int, dtype: torch.dtype, values: str | None) -> int:
    """Bytes one batch-1 product reads from the weight in format ``fmt`` (the cost model): values,
    positions / indices, row offsets and, for int8 values, the row scales."""
    esize = torch.empty((), dtype=dtype).element_size()
    if fmt in DENSE:
        return out_f * in_f * esize
    vsize = 1 if values == "int8" else esize
    scales = 4 * out_f if values == "int8" else 0
    bits = out_f * ((in_f + 7) // 8)
    if fmt == "bitmask":
        return nnz * vsize + bits + 8 * (out_f + 1) + scales
    if fmt == "nm24":
        return out_f * (in_f // 2) * vsize + bits + scales
    if fmt == "csr":
        return nnz * (4 + (2 if in_f <= 65536 else 4)) + 8 * (out_f + 1)
    raise SparsityError(f"auto: no cost model for format {fmt!r}.")


@register_backend
class AutoBackend(SparseBackend):
    """Wraps the backend chosen for one layer (decode) and how prefill runs; see the module docstring.

    Options (for :meth:`from_dense` and ``sparsify_for_inference(model, "auto", ...)``):
    ``formats`` (candidates, default all that apply), ``values`` (None or ``"int8"``), ``prefill_batch``
    (128), ``rounds`` (7), ``sample_layers`` (8), ``stream_bytes`` (64 MiB), ``margin`` (-0.03),
    ``model_tolerance`` (3.0), ``plan_cache`` (True), ``keep_dense_for_prefill`` (False), ``threads``;
    for a whole model also ``lm_head`` (True) and ``check`` (True).
    """

    name = "auto"
    capabilities = BackendCapabilities(
        devices=("cpu",),
        dtypes=(torch.float32, torch.bfloat16),
        training=False,
        int8_values=True,
        frees_dense=True,
        description="per layer the fastest of dense, native_dense, bitmask, nm24, csr (measured); never "
        "slower",
    )

    def __init__(self, weight: torch.Tensor, mask: torch.Tensor, **options: Any):
        options = {k: v for k, v in options.items() if k not in ("lm_head", "check")}
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
        the whole model's decoding against the model as it was (``check=False`` skips it)."""
        lm_head = options.pop("lm_head", True)
        check = options.pop("check", True)
        plan = plan_layers({t.name: (t.weight, t.mask) for t in targets}, **options)
        swaps: list[tuple[str, nn.Module]] = []
        choices: dict[str, dict] = {}
        for t in targets:
            b, prefill, keep, choice = plan[t.name]
            choices[t.module_name] = choice
            if b is not None:
                swaps.append((t.module_name, wrap(t.module, cls.from_plan(b, prefill, keep, choice))))
        head = _plan_lm_head(model, {t.module_name for t in targets}, options, wrap) if lm_head else None
        if head is not None:
            choices[head[0]] = head[2]
            if head[1] is not None:
                swaps.append((head[0], head[1]))
        if check and swaps:
            swaps = _check_whole_model(model, swaps, choices, plan_cache=options.get("plan_cache", True))
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


def _check_inputs(layers: dict, formats: tuple[str, ...] | None) -> tuple[str, ...]:
    """The formats to measure (dense first); a clear error for an unknown format or a layer auto can't run."""
    formats = tuple(formats or CANDIDATES)
    bad = [f for f in formats if f not in CANDIDATES]
    if bad:
        raise SparsityError(f"auto: unknown format(s) {bad}; choose from {', '.join(CANDIDATES)}.")
    if "dense" not in formats:
        formats = ("dense", *formats)  # the reference every choice is measured against
    if _native.load() is None:
        formats = tuple(f for f in formats if f == "dense")  # without the native kernels nothing beats dense
    for name, (w, _m) in layers.items():
        if w.device.type != "cpu" or w.dtype not in AutoBackend.capabilities.dtypes:
            raise SparsityError(
                f"auto: layer {name!r} is {w.dtype} on {w.device}; auto runs on CPU with float32 or bfloat16 "
                "weights. Cast or move the model (model.float(), model.to('cpu')), or use backend='csr' "
                "(any dtype, CUDA via torch.sparse) or 'masked_dense'."
            )
    return formats


def plan_layers(
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]],
    formats: tuple[str, ...] | None = None,
    prefill_batch: int = 128,
    rounds: int = 7,
    sample_layers: int = 8,
    margin: float = -0.03,
    stream_bytes: int = 64 << 20,
    keep_dense_for_prefill: bool = False,
    threads: int | None = None,
    values: str | None = None,
    activations: str | None = None,
    model_tolerance: float = 3.0,
    plan_cache: bool | str = True,
) -> dict[str, tuple]:
    """Choose a format per layer (``name -> (weight [out, in], mask)``); see the module docstring.

    Returns ``name -> (decode backend or None for dense, (prefill mode, prefill mode above 2x
    prefill_batch rows), prefill weight, choice dict)`` where a ``None`` backend means: leave the layer
    dense (``F.linear``).
    """
    formats = _check_inputs(layers, formats)
    if activations not in (None, "int8"):
        raise SparsityError(
            f"auto: activations={activations!r}: auto's int8 formats multiply int8 activations (the fast "
            "path it measures). For float32 activations pick the format yourself: bitmask, nm24 or "
            "native_dense with values='int8', activations='float32'."
        )
    if plan_cache not in (True, False, "refresh"):
        raise SparsityError(f"auto: plan_cache must be True, False or 'refresh', not {plan_cache!r}.")
    groups: dict[tuple, list[str]] = {}
    meta: dict[str, tuple] = {}
    for name, (w, m) in layers.items():
        nnz = int(m.sum())
        density = nnz / max(m.numel(), 1)
        is24 = w.shape[1] % 4 == 0 and _is_24(m)
        key = (tuple(w.shape), w.dtype, round(density * 20) / 20, is24)
        groups.setdefault(key, []).append(name)
        meta[name] = (density, is24, nnz)
    cache = PlanCache(plan_cache)
    settings = (prefill_batch, rounds, sample_layers, margin, stream_bytes, keep_dense_for_prefill, values)
    out: dict[str, tuple] = {}
    for key, names in groups.items():
        shape, dtype, level, is24 = key
        cands = [f for f in formats if (f != "nm24" or is24) and not (values and f == "csr")]
        ckey = cache.key("layer", shape, dtype, level, is24, cands, threads, settings)
        decided = cache.get(ckey)
        if decided is None:
            nnz = int(statistics.median(meta[n][2] for n in names))
            decided = _decide_group(
                layers, names, cands, nnz, prefill_batch, rounds, sample_layers, margin, stream_bytes,
                keep_dense_for_prefill, threads, values, model_tolerance,
            )  # fmt: skip
            cache.put(ckey, decided)
        else:
            decided = dict(decided, cached=True)
        best, best_pf, large_pf = decided["decode"], decided["prefill"], decided["prefill_large"]
        group = f"{shape[0]}x{shape[1]} {str(dtype).replace('torch.', '')} density~{level:.2f}{' 2:4' * is24}"
        for name in names:
            w, m = layers[name]
            choice = dict(decided, group=group, density=round(meta[name][0], 4))
            if values and best not in DENSE:
                choice["values"] = values
            if best == "dense":
                out[name] = (None, ("dense", "dense"), None, choice)
            elif best == "native_dense":  # batches above SMALL_BATCH run F.linear on its dense weight
                out[name] = (_build(best, w, m, threads), ("own", "own"), None, choice)
            else:  # the dense weight kept where a prefill regime runs on it (keep_dense_for_prefill)
                kept = (w * m.to(w.dtype)).contiguous() if "dense" in (best_pf, large_pf) else None
                out[name] = (_build(best, w, m, threads, values), (best_pf, large_pf), kept, choice)
        logger.info(
            "auto: %d layer(s) %s -> decode %s (%.2fx dense), prefill %s (%.2fx), %d+ rows %s (%.2fx)%s",
            len(names), group, best, decided["decode_vs_dense"], best_pf, decided["prefill_vs_dense"],
            2 * prefill_batch + 1, large_pf, decided["prefill_large_vs_dense"],
            " (cached plan)" if decided.get("cached") else "",
        )  # fmt: skip
    cache.save()
    return out


def _decide_group(
    layers, names, cands, nnz, prefill_batch, rounds, sample_layers, margin, stream_bytes, keep_dense,
    threads, values, tolerance,
) -> dict[str, Any]:  # fmt: skip
    """Measure one group and decide (module docstring, steps 2-6): the JSON-simple choice dict."""
    step = max(1, len(names) // sample_layers)
    sample = names[::step][:sample_layers]
    timed, copies = _streamed_copies(layers, sample, stream_bytes)
    w0 = layers[sample[0]][0]
    out_f, in_f = w0.shape
    model_bytes = {f: decode_bytes(f, out_f, in_f, nnz, w0.dtype, values) for f in cands}
    best, decode_ms, prefill_ms = _measure(
        timed, list(timed), cands, prefill_batch, rounds, threads, margin, values
    )
    bw = measure.read_bandwidth_gbs(threads=threads)
    modeled = {f: len(timed) * (b / bw / 1e6 + CALL_MS) for f, b in model_bytes.items()}
    rejected = _disagreeing(decode_ms, modeled, tolerance)
    if rejected:  # measure once more; what still disagrees with the cost model is not believed
        logger.info(
            "auto: %s disagree with the cost model by more than %.1fx; measuring again", rejected, tolerance
        )
        first = decode_ms
        best, decode_ms, prefill_ms = _measure(
            timed, list(timed), cands, prefill_batch, rounds, threads, margin, values
        )
        # other work only ever adds time: each candidate's faster of its two measurements (a dense timing
        # disturbed in one of them is not held against the sparse formats, nor a sparse one against them)
        decode_ms = {f: min(ms, first.get(f, ms)) for f, ms in decode_ms.items()}
        rejected = _disagreeing(decode_ms, modeled, tolerance)
        kept = [f for f in cands if f not in rejected]
        chosen = _choose({f: decode_ms[f] for f in kept}, kept, margin)
        if chosen != best:
            best = chosen
            if best not in DENSE:
                prefill_ms = [_prefill_ms_for(timed, best, xp_rows, rounds, threads, values)
                              for xp_rows in (prefill_batch, 4 * prefill_batch)]  # fmt: skip
            else:
                prefill_ms = [{"dense": 1.0}, {"dense": 1.0}]
    (best_pf, pf_ratio), (large_pf, large_ratio) = (
        _prefill_choice(best, ms, keep_dense) for ms in prefill_ms
    )
    return {
        "decode": best,
        "prefill": best_pf,
        "measured_on": len(sample),
        "timed_copies": copies,
        "decode_ms": {k: round(v, 4) for k, v in decode_ms.items()},
        "modeled_ms": {f: round(v, 4) for f, v in modeled.items()},
        "bytes_per_call": model_bytes,
        "read_gbs": round(bw, 2),
        "rejected": sorted(rejected),
        "prefill_ms": {k: round(v, 4) for k, v in prefill_ms[0].items()},
        "decode_vs_dense": round(decode_ms["dense"] / decode_ms[best], 3),
        "prefill_vs_dense": pf_ratio,
        "prefill_large": large_pf,
        "prefill_large_ms": {k: round(v, 4) for k, v in prefill_ms[1].items()},
        "prefill_large_vs_dense": large_ratio,
        "prefill_split": 2 * prefill_batch,
    }


def _disagreeing(decode_ms: dict[str, float], modeled_ms: dict[str, float], tolerance: float) -> set[str]:
    """Sparse candidates that measured more than ``tolerance`` times faster against the fastest dense
    variant than the cost model allows: a gain no byte count explains (a disturbed dense timing, not a
    faster format). Slower than the model is believed: choosing dense then is never wrong. The dense
    variants read the same bytes; the faster of them is the reference."""
    dense = [f for f in DENSE if f in decode_ms and f in modeled_ms]
    if not dense:
        return set()
    ref_f = min(dense, key=decode_ms.__getitem__)
    ref = decode_ms[ref_f]
    if not 0 < ref < float("inf"):
        return set()
    out = set()
    for f, ms in decode_ms.items():
        if f in DENSE or f not in modeled_ms or ms == float("inf"):
            continue
        ratio = (ms / ref) / (modeled_ms[f] / modeled_ms[ref_f])
        if ratio < 1 / tolerance:
            out.add(f)
    return out


def _choose(decode_ms: dict[str, float], cands: list[str], margin: float) -> str:
    """The fastest sparse candidate unless it is slower than the fastest dense one by more than
    ``-margin``; then that dense one."""
    for f in cands:
        decode_ms.setdefault(f, float("inf"))
    dense_best = min((f for f in cands if f in DENSE), key=decode_ms.__getitem__)
    sparse = [f for f in cands if f not in DENSE]
    best = min(sparse, key=decode_ms.__getitem__) if sparse else dense_best
    if decode_ms[best] == float("inf") or decode_ms[best] > decode_ms[dense_best] * (1 - margin):
        best = dense_best
    return best


def _prefill_ms_for(timed, best, rows, rounds, threads, values) -> dict[str, float]:
    names = list(timed)[:2]
    built = {
        "dense": [(timed[n][0] * timed[n][1].to(timed[n][0].dtype)).contiguous() for n in names],
        best: [_build(best, *timed[n], threads, values) for n in names],
    }
    in_f = timed[names[0]][0].shape[1]
    xp = torch.randn(rows, in_f, generator=torch.Generator().manual_seed(0)).to(timed[names[0]][0].dtype)
    with torch.inference_mode():
        return _prefill_ms(built, best, xp, rounds)


class PlanCache:
    """``auto``'s decisions on disk, keyed by CPU model, threads, layer group and options (a JSON file,
    ``$HF_SPARSITY_PLAN_CACHE`` or ``plans.json`` in the kernel cache folder; written atomically). A
    corrupt or unreadable file counts as empty."""

    def __init__(self, mode: bool | str = True):
        self.mode = mode
        self.path = os.environ.get("HF_SPARSITY_PLAN_CACHE") or os.path.join(
            _native.cache_dir(), "plans.json"
        )
        self.entries: dict[str, Any] = {}
        self.dirty = False
        if mode is True:
            try:
                with open(self.path, encoding="utf-8") as f:
                    data = json.load(f)
                self.entries = data if isinstance(data, dict) else {}
            except (OSError, ValueError):
                self.entries = {}

    @staticmethod
    def key(*parts: Any) -> str:
        cpu = hashlib.sha256(_native._cpu_id().encode()).hexdigest()[:12]
        text = json.dumps([PLAN_VERSION, cpu, torch.get_num_threads(), [str(p) for p in parts]])
        return hashlib.sha256(text.encode()).hexdigest()[:24]

    def get(self, key: str) -> dict | None:
        hit = self.entries.get(key) if self.mode is True else None
        return dict(hit) if isinstance(hit, dict) else None

    def put(self, key: str, value: dict) -> None:
        if self.mode is not False:
            self.entries[key] = value
            self.dirty = True

    def save(self) -> None:
        if not self.dirty:
            return
        try:
            folder = os.path.dirname(self.path) or "."
            os.makedirs(folder, exist_ok=True)
            try:  # merge with what another process wrote meanwhile
                with open(self.path, encoding="utf-8") as f:
                    merged = {**json.load(f), **self.entries}
            except (OSError, ValueError, TypeError):
                merged = self.entries
            fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(merged, f)
            os.replace(tmp, self.path)
            self.dirty = False
        except OSError as e:  # a read-only cache folder: plans are measured again next time
            logger.info("auto: could not write the plan cache %s: %s", self.path, e)


PREFILL_TIE = 0.05
"""Prefill: the sparse format's own batched kernel must beat unpack + GEMM by this fraction to be chosen."""


def _prefill_choice(best: str, ms: dict[str, float], keep_dense: bool) -> tuple[str, float]:
    """For one prefill batch size: ``(mode, x dense)``, mode ``"own"`` / ``"unpack"`` (the faster of the
    decode winner's two paths; ``"dense"`` for a dense winner, or with ``keep_dense`` where both lose)."""
    if best in DENSE:
        return "dense", 1.0
    pf = {"own": ms[f"{best}:own"], "unpack": ms[f"{best}:unpack"]}
    # a tie (within PREFILL_TIE) goes to unpack: the two are often within the noise of each other, and a
    # coin flip between them made repeated conversions plan differently
    mode = "own" if pf["own"] < pf["unpack"] * (1 - PREFILL_TIE) else "unpack"
    if keep_dense and pf[mode] > ms["dense"]:
        return "dense", 1.0
    return mode, round(ms["dense"] / pf[mode], 3)


def _streamed_copies(layers: dict, sample: list[str], stream_bytes: int) -> tuple[dict, int]:
    """Distinct copies of the ``sample`` layers (weights cloned, at most 64 copies) until one pass over
    them streams ``stream_bytes`` of dense weights: ``(name#copy -> (weight, mask), copies)``."""
    w0 = layers[sample[0]][0]
    per = w0.numel() * w0.element_size()
    copies = max(1, min(64, -(-stream_bytes // max(1, per * len(sample)))))
    timed = {
        f"{n}#{i}": (layers[n][0].clone() if i else layers[n][0], layers[n][1])
        for i in range(copies)
        for n in sample
    }
    return timed, copies


def _build_copies(fmt: str, layers: dict, names: list[str], threads, values) -> list[SparseBackend]:
    """One backend per name; the streamed copies of a layer (``name#i``, :func:`_streamed_copies`) are deep
    copies of its first one (distinct memory, as the copies must be, without packing the weight again)."""
    first: dict[str, SparseBackend] = {}
    out = []
    for n in names:
        base = n.split("#", 1)[0]
        if base in first:
            out.append(copy.deepcopy(first[base]))
        else:
            first[base] = _build(fmt, *layers[n], threads, values)
            out.append(first[base])
    return out


def _measure(layers, sample, cands, prefill_batch, rounds, threads, margin, values=None):
    """Decode: median ms of one pass over the ``sample`` layers per candidate (batch 1); then prefill
    (``prefill_batch`` rows and four times as many, two layers) of dense and of the decode winner's own
    path and unpack path. Returns ``(best, decode_ms, [prefill_ms, prefill_ms at 4x the rows])``."""
    built: dict[str, list] = {}
    for f in cands:
        try:
            if f == "dense":
                built[f] = [(layers[n][0] * layers[n][1].to(layers[n][0].dtype)).contiguous() for n in sample]
            else:
                built[f] = _build_copies(f, layers, sample, threads, None if f in DENSE else values)
        except SparsityError:
            continue
    in_f = layers[sample[0]][0].shape[1]
    dtype = layers[sample[0]][0].dtype
    g = torch.Generator().manual_seed(0)
    x1 = torch.randn(1, in_f, generator=g).to(dtype)
    xps = [torch.randn(n, in_f, generator=g).to(dtype) for n in (prefill_batch, 4 * prefill_batch)]

    def run(f, x):
        if f == "dense":
            return lambda: [F.linear(x, w) for w in built[f]]
        return lambda: [b.linear(x) for b in built[f]]

    with torch.inference_mode():
        decode_ms = interleaved_ms({f: run(f, x1) for f in built}, rounds, stat="min")
        best = _choose(decode_ms, cands, margin)  # candidates that could not be built: inf, never chosen
        prefill_ms = [_prefill_ms(built, best, xp, rounds) for xp in xps]
    return best, decode_ms, prefill_ms


def _product_input(b, x: torch.Tensor) -> torch.Tensor:
    return b.product_input(x) if hasattr(b, "product_input") else x


def _prefill_ms(built: dict, best: str, xp: torch.Tensor, rounds: int) -> dict[str, float]:
    """ms of two layers at the rows of ``xp``: dense, and the decode winner's own / unpack paths; each the
    fastest of its rounds, as for decoding (other work only ever adds time: beside a competing job the
    median flipped the choice between own and unpack in two groups of SmolLM2's plan)."""
    two = built["dense"][:2]
    fns = {"dense": lambda: [F.linear(xp, w) for w in two]}
    if best not in DENSE:
        bs = built[best][:2]
        fns[f"{best}:own"] = lambda: [b.linear(xp) for b in bs]
        unpack = (
            (lambda b: b.dense_for_matmul())
            if hasattr(bs[0], "dense_for_matmul")
            else (lambda b: b.to_dense())
        )
        # as AutoBackend.linear runs it: on the activations the format's products see (int8 ones included)
        fns[f"{best}:unpack"] = lambda: [F.linear(_product_input(b, xp), unpack(b).to(xp.dtype)) for b in bs]
    return interleaved_ms(fns, max(3, rounds // 3), stat="min")


def _plan_lm_head(model: nn.Module, taken: set[str], options: dict, wrap: Wrap) -> tuple | None:
    """``(module name, replacement or None, choice)`` for the output embedding: dense vs native GEMV."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear) or head.weight.device.type != "cpu":
        return None
    if head.weight.dtype not in AutoBackend.capabilities.dtypes:
        return None
    name = next((n for n, m in model.named_modules() if m is head), None)
    if name is None or name in taken:
        return None
    w = head.weight.detach()
    if options.get("values") == "int8":  # asked for: the int8 GEMV reads a quarter of fp32's bytes, no timing
        b = get_backend("native_dense").from_dense(
            w,
            torch.ones((), dtype=torch.uint8).expand(w.shape),
            threads=options.get("threads"),
            values="int8",
        )
        choice = {"decode": "native_dense", "values": "int8", "prefill": "unpack", "lm_head": True}
        return (
            name,
            wrap(head, AutoBackend.from_plan(b, ("unpack", "unpack"), None, choice), keep_dense=True),
            choice,
        )
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


def _predicted_ratio(choices: dict, dense_tok_s: float) -> float:
    """The converted model's decoding speed against dense that the layer measurements predict: the dense
    token time, less the converted layers' dense times, plus their chosen formats' times."""
    token_ms = 1e3 / dense_tok_s
    saved = 0.0
    for c in choices.values():
        ms = c.get("decode_ms") or {}
        per = max(1, c.get("measured_on", 1) * c.get("timed_copies", 1))
        if c.get("decode") in ms and "dense" in ms:
            saved += (ms["dense"] - ms[c["decode"]]) / per
    return token_ms / max(token_ms - saved, 1e-6)


def _check_whole_model(
    model: nn.Module, swaps: list, choices: dict, rounds: int = 3, tokens: int = 8, plan_cache=True
) -> list:
    """The per-layer plan checked on the whole model: greedy decoding of ``tokens`` tokens with and without
    the swaps, interleaved ``rounds`` times (the fastest round of each). If the converted model is slower,
    no layer is converted (recorded as ``whole_model_check`` in every choice). A slower verdict the layer
    measurements contradict (they predict 10% or more gained) is measured again, with more rounds, before
    it counts. The verdict is cached with the plan."""
    if not hasattr(model, "generate") or not getattr(getattr(model, "config", None), "vocab_size", None):
        return swaps
    cache = PlanCache(plan_cache)
    signature = sorted(
        (name, c.get("decode"), c.get("prefill"), c.get("group")) for name, c in choices.items()
    )
    ckey = cache.key("model", type(model).__name__, model.config.vocab_size, signature)
    verdict = cache.get(ckey)
    if verdict is None:
        ratio, dense_tok_s = _time_whole_model(model, swaps, rounds, tokens)
        predicted = _predicted_ratio(choices, dense_tok_s)
        again = ratio < 1.0 and predicted >= 1.1
        if again:
            ratio, dense_tok_s = _time_whole_model(model, swaps, rounds + 2, tokens)
        verdict = {
            "auto_vs_dense": round(ratio, 3),
            "kept": ratio >= 1.0,
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
        "auto: the converted model decoded at %.2fx dense in the whole-model check; keeping every layer "
        "dense.",
        verdict["auto_vs_dense"],
    )
    for c in choices.values():
        c["planned"] = {k: c[k] for k in PLAN_KEYS}
        c.update(zip(PLAN_KEYS, ("dense", 1.0) * 3))
    return []


def _time_whole_model(model: nn.Module, swaps: list, rounds: int, tokens: int) -> tuple[float, float]:
    """``(converted / dense tok/s, dense tok/s)``, interleaved, the fastest of ``rounds`` each."""
    originals = {name: model.get_submodule(name) for name, _ in swaps}
    ids = torch.randint(2, int(model.config.vocab_size), (1, 8), generator=torch.Generator().manual_seed(0))
    speeds: dict[str, list[float]] = {"dense": [], "auto": []}
    was_training = model.training
    model.eval()
    try:
        measure.decode_tok_s(model, ids, 2)
        for name, new in swaps:
            replace_module(model, name, new)
        measure.decode_tok_s(model, ids, 2)
        for _ in range(rounds):
            for name, old in originals.items():
                replace_module(model, name, old)
            speeds["dense"].append(measure.decode_tok_s(model, ids, tokens))
            for name, new in swaps:
                replace_module(model, name, new)
            speeds["auto"].append(measure.decode_tok_s(model, ids, tokens))
    finally:
        for name, old in originals.items():
            replace_module(model, name, old)
        model.train(was_training)
    return max(speeds["auto"]) / max(speeds["dense"]), max(speeds["dense"])
