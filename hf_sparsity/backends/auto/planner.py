"""``auto``'s planner: groups of like layers, measured round-robin against the cost model, decided
(decode format, prefill modes) and cached; steps 1-6 and 8 of :mod:`hf_sparsity.backends.auto`."""

from __future__ import annotations

import copy
import logging
import statistics
from typing import Any

import torch
import torch.nn.functional as F

from ...utils import SparsityError
from .. import _native, measure
from ..base import SparseBackend
from ..measure import interleaved_ms
from .cache import PlanCache
from .cost import CALL_MS, CANDIDATES, DENSE, DTYPES, _build, _is_24, _product_input, decode_bytes

logger = logging.getLogger("hf_sparsity.backends.auto")


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
        if w.device.type != "cpu" or w.dtype not in DTYPES:
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
    settings = (prefill_batch, rounds, sample_layers, margin, stream_bytes, keep_dense_for_prefill, values,
                model_tolerance)  # fmt: skip
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
            if values and best != "dense":
                choice["values"] = values
            if best == "dense":
                out[name] = (None, ("dense", "dense"), None, choice)
            elif best == "native_dense":  # batches above SMALL_BATCH run F.linear on its dense weight
                out[name] = (_build(best, w, m, threads, values), ("own", "own"), None, choice)
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
    timed, copies = _streamed_copies(layers, sample, stream_bytes, 1 if values == "int8" else None)
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
    faster format). Slower than the model is believed: choosing dense then is never wrong. The faster dense
    variant is the reference (with int8 values ``native_dense``'s int8 GEMV, of the candidates' own value
    type: against float32, whose copies leave the cache where the int8 ones stay in it, every int8 format
    would look too fast)."""
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


def _streamed_copies(
    layers: dict, sample: list[str], stream_bytes: int, esize: int | None = None
) -> tuple[dict, int]:
    """Distinct copies of the ``sample`` layers (weights cloned, at most 64 copies) until one pass over
    them streams ``stream_bytes`` of dense weights of ``esize`` bytes per weight (default: the weights'
    own; 1 for int8 values, so the int8 formats' pass streams from memory as a model's does, not from the
    cache): ``(name#copy -> (weight, mask), copies)``."""
    w0 = layers[sample[0]][0]
    per = w0.numel() * (esize or w0.element_size())
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
                built[f] = _build_copies(f, layers, sample, threads, values)
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
