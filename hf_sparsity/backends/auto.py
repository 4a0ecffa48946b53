"""``auto``: per layer, the fastest of dense and each sparse format, measured at conversion.

Decoding (batch 1) and prefill (a batch of ``prefill_batch`` rows, default 128) are
measured separately, on this machine, with the current thread count:

1. Layers are grouped by shape, dtype, density (to 0.05) and whether the mask is 2:4;
   layers in a group compute the same amount of work the same way.
2. For each group, every candidate format (``dense`` = ``F.linear``, ``native_dense``,
   ``bitmask``, ``nm24`` for 2:4 masks, ``csr``) is built for up to ``sample_layers``
   layers of the group, and one pass over those layers is timed round-robin (dense,
   bitmask, ..., dense, ...) for ``rounds`` rounds; medians. The pass streams through
   distinct copies of the sample until it covers ``stream_bytes`` (64 MiB) of dense weights,
   so the weights come from memory, as in a real decode step, rather than from the cores'
   caches: eight of SmolLM2-135M's 192x576 K/V projections (3.5 MB) stay in cache and measured
   bitmask at 50% 0.86x dense, though converting them made the model faster.
3. The decode choice is the fastest sparse candidate, unless it is slower than the fastest
   dense variant by more than ``-margin`` (default ``margin=-0.03``: 3% slower is still a tie):
   then the dense variant. Ties go to the sparse format because it holds fewer bytes, and
   because the sample's few small layers stay in cache, which flatters dense (SmolLM2-135M's
   192x576 K/V projections at 50% measured 1.00x alone and are faster in the model, where every
   weight streams from memory). A positive ``margin`` asks a sparse format to win by that much.
   The whole-model check (``hf_sparsity.inference``) reverts the plan if the converted model
   decodes slower than dense.
4. Prefill: for the chosen format, its own batched path (from 17 rows the blocked sparse kernel,
   see the C source's ``hfs_spmm``) and "unpack" (rebuild the dense weight, one GEMM) are timed
   against dense ``F.linear`` at ``prefill_batch`` rows and at four times as many; the faster of
   the two is used for batches up to twice ``prefill_batch`` (``prefill``) and above
   (``prefill_large``): the blocked kernel's gain shrinks as the GEMM gets more efficient with
   more rows (SmolLM2-135M's shapes at 50%: 0.79-1.02x dense at 128 rows, 0.75-0.99x at 512,
   where the unpack reaches 0.81-0.95x). If both are slower than dense,
   ``keep_dense_for_prefill=True`` keeps the dense weight for prefill (more memory); by default
   the faster path is used and the ratio recorded.

The choice, with every measured time, is in :attr:`AutoBackend.choice`; for a whole model,
:func:`hf_sparsity.inference.auto_report` prints the per-layer table.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from ..utils import SparsityError
from . import _native
from .base import BackendCapabilities, SparseBackend, check_nm
from .formats import SMALL_BATCH
from .timing import interleaved_ms

logger = logging.getLogger(__name__)

CANDIDATES = ("dense", "native_dense", "bitmask", "nm24", "csr")
DENSE = ("dense", "native_dense")


def _is_24(mask: torch.Tensor) -> bool:
    try:
        check_nm(mask, 2, 4)
        return True
    except SparsityError:
        return False


def _build(
    fmt: str, w: torch.Tensor, m: torch.Tensor, threads: int | None, values: str | None = None
) -> SparseBackend:
    from . import get_backend

    if fmt == "dense":
        return get_backend("native_dense").from_dense(w, m, kernel="torch")
    if fmt == "native_dense":
        return get_backend(fmt).from_dense(w, m, threads=threads)
    if fmt == "csr":
        b = get_backend("csr").from_dense(w, m, kernel="native", threads=threads)
        _slim_csr(b)
        return b
    return get_backend(fmt).from_dense(w, m, prefill="native", threads=threads, values=values)


def _slim_csr(b: SparseBackend) -> None:
    """Drop the dense weight and mask a ``csr`` backend keeps (auto never trains or refreshes)."""
    b.__dict__["weight"] = torch.empty(0, dtype=b.weight.dtype)
    b.__dict__["mask"] = torch.ones((), dtype=torch.uint8).expand(b.out_features, b.in_features)


class AutoBackend(SparseBackend):
    """Wraps the backend chosen for one layer (decode) and how prefill runs; see the module docstring.

    Options (for :meth:`from_dense` and ``sparsify_for_inference(model, "auto", ...)``):
    ``formats`` (candidates, default all that apply), ``prefill_batch`` (128), ``rounds`` (7),
    ``sample_layers`` (8), ``stream_bytes`` (64 MiB), ``margin`` (-0.03), ``keep_dense_for_prefill``
    (False), ``threads``.
    """

    name = "auto"
    capabilities = BackendCapabilities(
        devices=("cpu",),
        dtypes=(torch.float32, torch.bfloat16),
        training=False,
        int8_values=True,
        description="per layer the fastest of dense, native_dense, bitmask, nm24, csr (measured); never "
        "slower",
    )

    def __init__(self, weight: torch.Tensor, mask: torch.Tensor, **options: Any):
        b, prefill, keep, choice = plan_layers({"layer": (weight, mask)}, **options)["layer"]
        if b is None:  # dense won: F.linear on the masked weight
            b = _build("dense", weight, mask, options.get("threads"))
        self._adopt((b, prefill, keep, choice))

    @classmethod
    def _wrap(
        cls, decode: SparseBackend, prefill: str | tuple[str, str], prefill_weight, choice: dict
    ) -> AutoBackend:
        self = cls.__new__(cls)
        self._adopt((decode, prefill, prefill_weight, choice))
        return self

    def _adopt(self, parts) -> None:
        from .base import _new_counters

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
        return F.linear(x, w.to(x.dtype), bias)

    __call__ = linear

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
) -> dict[str, tuple]:
    """Choose a format per layer (``name -> (weight [out, in], mask)``); see the module docstring.

    Returns ``name -> (decode backend or None for dense, (prefill mode, prefill mode above 2x
    prefill_batch rows), prefill weight, choice dict)`` where a ``None`` backend means: leave the layer
    dense (``F.linear``).
    """
    formats = _check_inputs(layers, formats)
    groups: dict[tuple, list[str]] = {}
    meta: dict[str, tuple] = {}
    for name, (w, m) in layers.items():
        density = float(m.sum()) / max(m.numel(), 1)
        is24 = w.shape[1] % 4 == 0 and _is_24(m)
        key = (tuple(w.shape), w.dtype, round(density * 20) / 20, is24)
        groups.setdefault(key, []).append(name)
        meta[name] = (density, is24)
    out: dict[str, tuple] = {}
    for key, names in groups.items():
        shape, dtype, _, is24 = key
        cands = [f for f in formats if (f != "nm24" or is24) and not (values and f == "csr")]
        step = max(1, len(names) // sample_layers)
        sample = names[::step][:sample_layers]
        timed, copies = _streamed_copies(layers, sample, stream_bytes)
        best, decode_ms, prefill_ms = _measure(
            timed, list(timed), cands, prefill_batch, rounds, threads, margin, values
        )
        pf_choice = [_prefill_choice(best, ms, keep_dense_for_prefill) for ms in prefill_ms]
        (best_pf, pf_ratio), (large_pf, large_ratio) = pf_choice
        for name in names:
            w, m = layers[name]
            choice = {
                "decode": best,
                "prefill": best_pf,
                "group": f"{shape[0]}x{shape[1]} {str(dtype).replace('torch.', '')} "
                f"density~{key[2]:.2f}{' 2:4' if is24 else ''}",
                "measured_on": len(sample),
                "timed_copies": copies,
                "decode_ms": {k: round(v, 4) for k, v in decode_ms.items()},
                "prefill_ms": {k: round(v, 4) for k, v in prefill_ms[0].items()},
                "decode_vs_dense": round(decode_ms["dense"] / decode_ms[best], 3),
                "prefill_vs_dense": pf_ratio,
                "prefill_large": large_pf,
                "prefill_large_ms": {k: round(v, 4) for k, v in prefill_ms[1].items()},
                "prefill_large_vs_dense": large_ratio,
                "prefill_split": 2 * prefill_batch,
                "density": round(meta[name][0], 4),
            }
            if best == "dense":
                out[name] = (None, ("dense", "dense"), None, choice)
            elif best == "native_dense":  # batches above SMALL_BATCH run F.linear on its dense weight
                out[name] = (_build(best, w, m, threads), ("own", "own"), None, choice)  # dense: no int8
            else:  # the dense weight kept where a prefill regime runs on it (keep_dense_for_prefill)
                kept = (w * m.to(w.dtype)).contiguous() if "dense" in (best_pf, large_pf) else None
                out[name] = (_build(best, w, m, threads, values), (best_pf, large_pf), kept, choice)
        logger.info(
            "auto: %d layer(s) %s -> decode %s (%.2fx dense), prefill %s (%.2fx dense), %d+ rows %s (%.2fx)",
            len(names),
            out[names[0]][3]["group"],
            best,
            out[names[0]][3]["decode_vs_dense"],
            best_pf,
            pf_ratio,
            2 * prefill_batch + 1,
            large_pf,
            large_ratio,
        )
    return out


def _prefill_choice(best: str, ms: dict[str, float], keep_dense: bool) -> tuple[str, float]:
    """For one prefill batch size: ``(mode, x dense)``, mode ``"own"`` / ``"unpack"`` (the faster of the
    decode winner's two paths; ``"dense"`` for a dense winner, or with ``keep_dense`` where both lose)."""
    if best in DENSE:
        return "dense", 1.0
    pf = {"own": ms[f"{best}:own"], "unpack": ms[f"{best}:unpack"]}
    mode = min(pf, key=pf.__getitem__)
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
                built[f] = [_build(f, *layers[n], threads, None if f in DENSE else values) for n in sample]
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
        decode_ms = interleaved_ms({f: run(f, x1) for f in built}, rounds)
        for f in cands:  # candidates that could not be built are absent: never chosen
            decode_ms.setdefault(f, float("inf"))
        dense_best = min((f for f in cands if f in DENSE), key=decode_ms.__getitem__)
        sparse = [f for f in cands if f not in DENSE]
        best = min(sparse, key=decode_ms.__getitem__) if sparse else dense_best
        if decode_ms[best] == float("inf") or decode_ms[best] > decode_ms[dense_best] * (1 - margin):
            best = dense_best  # a sparse format must be within ``margin`` of the fastest dense variant
        prefill_ms = [_prefill_ms(built, best, xp, rounds) for xp in xps]
    return best, decode_ms, prefill_ms


def _prefill_ms(built: dict, best: str, xp: torch.Tensor, rounds: int) -> dict[str, float]:
    """Median ms of two layers at the rows of ``xp``: dense, and the decode winner's own / unpack paths."""
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
        fns[f"{best}:unpack"] = lambda: [F.linear(xp, unpack(b).to(xp.dtype)) for b in bs]
    return interleaved_ms(fns, max(3, rounds // 3))
