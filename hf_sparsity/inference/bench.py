"""Timing sparse backends against dense: one layer, or a whole model's greedy decoding.

The harness behind ``hf_sparsity bench`` (the CLI in :mod:`hf_sparsity.cli.bench` only parses
arguments) and ``benchmarks/backends.py``; the library never imports it:

* :func:`bench_layer`: one ``[out, in]`` layer, interleaved dense / backend timings, error vs the emulator;
* :func:`bench_model`: whole-model greedy decoding, dense vs a backend, interleaved rounds;
* :func:`decode_breakdown`: per-token milliseconds split into sparse layers, LM head and the rest;
* :func:`interleaved_ms`, :func:`decode_tok_s`, :func:`speedup_bounds`, :func:`modeled_model_speedup`.

``ratio`` is ``dense_ms / backend_ms`` for a layer and ``backend_tok_s / dense_tok_s`` for a model
(above 1: the backend is faster).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import Any

import torch
from torch import nn

from .. import masks as M
from ..backends import EmulatorBackend, MachineSpec, get_backend
from ..backends.auto import PLAN_KEYS
from ..backends.measure import (  # noqa: F401
    decode_tok_s,
    interleaved_ms,
    kernel_read_gbs,
    peak_read_gbs,
    read_bandwidth_gbs,
)
from ..constants import SPARSITY_MASKS_NAME
from ..loading import load_model_folder
from ..mask_engine.config import SparsityConfig, check_level, check_structure
from ..mask_engine.engine import SparsityEngine
from ..modeling import apply_masks, is_conv1d, linear_dims
from ..utils import SparsityError
from .conversion import (
    SparseLinear,
    auto_choices,
    resolve_masks,
    restore_dense,
    sparse_layers,
    sparsify_for_inference,
)
from .loop import forward_step, greedy_tokens


# ---------------------------------------------------------------------------- helpers
def parse_shape(text: str) -> tuple[int, int]:
    """``"768x3072"`` -> ``(768, 3072)`` (OUT x IN, nn.Linear order)."""
    try:
        out_f, in_f = (int(p) for p in str(text).lower().replace("*", "x").split("x"))
        if out_f <= 0 or in_f <= 0:
            raise ValueError
    except ValueError:
        raise SparsityError(
            f"--shape {text!r} is not OUTxIN with positive integers (e.g. 768x3072)."
        ) from None
    return out_f, in_f


def make_mask(weight: torch.Tensor, sparsity: float, init: str, structure: str | None, seed: int = 0):
    """A uint8 ``[out, in]`` mask: random / topk at ``sparsity``, or N:M along the input dim."""

    if structure:
        n, m = check_structure(structure)
        score = (
            M.magnitude_score(weight)
            if init == "topk"
            else torch.rand(weight.shape, generator=torch.Generator().manual_seed(int(seed)))
        )
        return M.nm_mask(score, n, m, dim=1)
    level = check_level(sparsity, "--sparsity")
    if init == "topk":
        return M.topk_mask(weight.float().cpu(), level)
    return M.random_mask(tuple(weight.shape), level, seed, "bench")


def bench_layer(
    backend: str,
    sparsity: float = 0.9,
    shape: tuple[int, int] = (768, 3072),
    batch: int = 1,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    init: str = "random",
    structure: str | None = None,
    repeats: int = 30,
    inner: int = 5,
    seed: int = 0,
    **options: Any,
) -> dict[str, Any]:
    """Time one ``[out, in]`` layer on ``backend`` against dense ``F.linear``; error vs the emulator."""

    klass = get_backend(backend)
    if klass.capabilities.structure and not structure:
        structure = klass.capabilities.structure
    g = torch.Generator().manual_seed(seed)
    out_f, in_f = shape
    w = torch.randn(out_f, in_f, generator=g).div_(in_f**0.5)
    x = torch.randn(batch, in_f, generator=g)
    mask = make_mask(w, sparsity, init, structure, seed)
    w = (w * mask).to(device=device, dtype=dtype)
    x = x.to(device=device, dtype=dtype)
    prepared = klass.from_dense(w, mask.to(device), **options)
    with torch.no_grad():
        ref = get_backend("emulator").from_dense(w.cpu(), mask, float64_accumulator=True).linear(x.cpu())
        got = prepared.linear(x)
        err = (got.double().cpu() - ref.double()).abs().max().item() if got.numel() else 0.0
        t = interleaved_ms(
            {"dense": lambda: torch.nn.functional.linear(x, w), "backend": lambda: prepared.linear(x)},
            repeats,
            inner,
            device,
        )
    nnz = int(mask.sum())
    return {
        "backend": klass.name,
        "kernel": getattr(prepared, "kernel", None),
        "shape": [out_f, in_f],
        "batch": batch,
        "dtype": str(dtype).replace("torch.", ""),
        "device": str(device),
        "sparsity": round(1 - nnz / mask.numel(), 6),
        "nnz": nnz,
        "threads": torch.get_num_threads(),
        "dense_ms": round(t["dense"], 4),
        "backend_ms": round(t["backend"], 4),
        "ratio": round(t["dense"] / t["backend"], 3) if t["backend"] > 0 else float("inf"),
        "max_abs_err": err,
    }


def build_masks_for(
    model, sparsity: float | None, masks: str | None, model_dir: str | None, init: str = "topk"
):
    """Masks for a model bench: ``masks`` (path or "zeros"), else the model folder's file, else
    prune to ``sparsity``."""

    if masks:
        return resolve_masks(model, masks, None), f"masks={masks}"
    if model_dir and os.path.isfile(os.path.join(model_dir, SPARSITY_MASKS_NAME)):
        return resolve_masks(model, model_dir, None), f"{SPARSITY_MASKS_NAME}"
    if sparsity is None:
        raise SparsityError(
            f"{model_dir} holds no {SPARSITY_MASKS_NAME}. Pass --masks zeros (a finalized checkpoint's exact "
            "zeros), --masks PATH, or --sparsity S to prune the targeted layers by magnitude for the bench."
        )

    eng = SparsityEngine(model, SparsityConfig(sparsity=sparsity, init_method=init))
    eng.build_masks()
    eng.apply()
    return dict(eng.masks), f"{init} pruning to {sparsity}"


def decode_breakdown(model, ids: torch.Tensor, new_tokens: int, layers) -> dict[str, float]:
    """Per-token milliseconds of greedy decoding, split into ``layers``, the LM head and the rest.

    Runs greedy decoding's forward loop (:func:`~hf_sparsity.inference.loop.forward_step`:
    prefill, then one token per forward over the KV cache, under ``torch.inference_mode``) with
    timing hooks on the modules named in ``layers`` (the sparsified ones, whether currently dense
    or swapped) and on the output embedding.
    ``rest`` is everything else: attention, norms, activations, the KV cache, Python.
    The hooks add about a microsecond per call to what they time.
    """
    head = model.get_output_embeddings()
    if head is None:  # no LM head: its share reads 0
        head = torch.nn.Identity()
    mods = [model.get_submodule(n) for n in layers]
    acc = {"layers": 0.0, "head": 0.0}
    start: dict[int, float] = {}

    def pre(m, args):
        start[id(m)] = time.perf_counter()

    def post_fn(key):
        def post(m, args, out):
            acc[key] += time.perf_counter() - start[id(m)]

        return post

    handles = [m.register_forward_pre_hook(pre) for m in [*mods, head]]
    handles += [m.register_forward_hook(post_fn("layers")) for m in mods]
    handles.append(head.register_forward_hook(post_fn("head")))
    try:
        with torch.inference_mode():
            first, step = forward_step(model, ids)
            acc["layers"] = acc["head"] = 0.0
            t = time.perf_counter()
            greedy_tokens(first, step, new_tokens + 1)  # new_tokens forwards after the prompt's
            total = time.perf_counter() - t
    finally:
        for h in handles:
            h.remove()
    ms = 1e3 / new_tokens
    return {
        "total_ms": total * ms,
        "layers_ms": acc["layers"] * ms,
        "lm_head_ms": acc["head"] * ms,
        "rest_ms": (total - acc["layers"] - acc["head"]) * ms,
    }


def speedup_bounds(dense: dict[str, float], density: float) -> dict[str, float]:
    """What a dense per-token breakdown allows: the whole-model speedup if the sparse layers took no
    time at all, and if they were exactly ``1 / density`` times faster than dense (the multiply-add bound)."""
    fixed = dense["total_ms"] - dense["layers_ms"]
    return {
        "bound_layers_free": dense["total_ms"] / fixed,
        "bound_layers_ideal": dense["total_ms"] / (fixed + dense["layers_ms"] * density),
    }


def modeled_model_speedup(model, machine=None) -> dict[str, Any]:
    """Modeled batch-1 decode cycles of every linear layer on the emulator's machine, sparse vs dense.

    Sparse layers (on any backend) count their nonzeros; linear layers left dense
    (``lm_head``, untargeted projections) count every weight. Attention scores, norms and
    embeddings are not modeled.
    """

    machine = machine or MachineSpec()
    sparse_c = sparse_d = other = 0
    macs = macs_dense = 0
    for mod in model.modules():
        if isinstance(mod, SparseLinear):
            b = mod.backend
            if isinstance(b, EmulatorBackend):
                load, rows = b.row_load, b.rows_per_pe
            else:
                counts = b.mask.sum(1, dtype=torch.int64)
                load, rows = (
                    EmulatorBackend.pe_max_load(counts, machine.pes),
                    math.ceil(b.out_features / machine.pes),
                )
            sparse_c += load + rows * machine.row_overhead
            sparse_d += rows * b.in_features + rows * machine.row_overhead
            macs += b.nnz
            macs_dense += b.out_features * b.in_features
        elif linear_dims(mod) is not None:
            in_f, out_f = linear_dims(mod)
            other += math.ceil(out_f / machine.pes) * (in_f + machine.row_overhead)
            macs += out_f * in_f
            macs_dense += out_f * in_f
    return {
        "machine": {
            "pes": machine.pes,
            "axpy_width": machine.axpy_width,
            "row_overhead": machine.row_overhead,
        },
        "sparse_layer_cycles": sparse_c,
        "sparse_layer_dense_cycles": sparse_d,
        "dense_layer_cycles": other,
        "modeled_speedup_sparse_layers": round(sparse_d / sparse_c, 3) if sparse_c else None,
        "modeled_speedup_all_linear": round((sparse_d + other) / (sparse_c + other), 3)
        if sparse_c + other
        else None,
        "macs_per_token": macs,
        "dense_macs_per_token": macs_dense,
    }


def auto_groups(model) -> tuple[dict[str, dict[str, Any]], dict | None]:
    """``auto``'s choices per group of like layers (the LM head apart), and its whole-model check."""

    groups: dict[str, dict[str, Any]] = {}
    check = None
    for c in auto_choices(model).values():
        key = c.get("group", "int8 values") + (" (LM head)" if c.get("lm_head") else "")
        g = groups.setdefault(key, {k: c.get(k) for k in PLAN_KEYS} | {"layers": 0})
        g["layers"] += 1
        check = c.get("whole_model_check", check)
    return groups, check


def bench_model(
    model_dir: str,
    backend: str = "csr",
    masks: str | None = None,
    sparsity: float | None = None,
    new_tokens: int = 32,
    prompt_len: int = 16,
    rounds: int = 3,
    dtype: str | torch.dtype | None = None,
    seed: int = 0,
    model=None,
    **options: Any,
) -> dict[str, Any]:
    """Whole-model greedy decoding, dense vs ``backend``, interleaved rounds; medians and ratio."""

    klass = get_backend(backend)
    if model is None:  # the masks are chosen below (``masks`` / ``sparsity`` / the folder's)
        model, _ = load_model_folder(model_dir, dtype=dtype, masks=False)
    model.eval()
    found, source = build_masks_for(model, sparsity, masks, model_dir)
    with torch.no_grad():  # the dense baseline is the masked model, so both compute the same function
        apply_masks(model, found)
    g = torch.Generator().manual_seed(seed)
    vocab = int(model.config.vocab_size)
    ids = torch.randint(2, vocab, (1, prompt_len), generator=g).to(model.device)
    emulated = klass.name == "emulator"
    if emulated:
        new_tokens = min(new_tokens, 4)  # the emulator is a reference, not a fast path
    with torch.no_grad():
        dense_logits = model(ids).logits
    dense_t, back_t, err = _interleaved_decode(
        model, klass, found, ids, dense_logits, new_tokens, rounds, options
    )
    # auto may also swap the LM head (native GEMV), int8 values the head too: it is not a sparse layer
    layers = {n: m for n, m in sparse_layers(model).items() if not m.lm_head}
    nnz = sum(m.backend.nnz for m in layers.values())
    numel = sum(m.backend.out_features * m.backend.in_features for m in layers.values())  # no mask rebuilt
    kernels = sorted({str(getattr(m.backend, "kernel", klass.name)) for m in layers.values()})
    out: dict[str, Any] = {
        "model": str(model_dir),
        "backend": klass.name,
        "kernel": ",".join(kernels),
        "masks": source,
        "sparse_layers": len(layers),
        "sparsity_of_sparse_layers": round(1 - nnz / max(numel, 1), 6),
        "threads": torch.get_num_threads(),
        "new_tokens": new_tokens,
        "rounds": rounds,
        "dense_tok_s": round(statistics.median(dense_t), 3),
        "backend_tok_s": round(statistics.median(back_t), 3),
        "ratio": round(statistics.median(back_t) / statistics.median(dense_t), 3),
        "max_abs_err": err,
    }
    if klass.name == "auto":
        out["auto_groups"], check = auto_groups(model)
        if check is not None:
            out["auto_whole_model_check"] = check
    if emulated:
        fwd = [m.backend.counters["forward"] for m in layers.values()]
        out["emulated_macs"] = sum(c.macs for c in fwd)
        out["emulated_macs_skipped"] = sum(c.macs_skipped for c in fwd)
    out.update(modeled_model_speedup(model))
    if not emulated:  # where the time goes, per token; what the dense parts leave to gain
        out.update(_split_backend_vs_dense(model, ids, new_tokens, list(layers), nnz / max(numel, 1)))
    else:
        restore_dense(model)
    return out


def _interleaved_decode(model, klass, masks, ids, dense_logits, new_tokens, rounds, options):
    """Rounds of dense, then converted, greedy decoding (the model is left converted); the logit error."""

    dense_t, back_t = [], []
    decode_tok_s(model, ids, 2)  # warm-up
    for r in range(rounds):
        dense_t.append(decode_tok_s(model, ids, new_tokens))
        sparsify_for_inference(model, klass, masks=masks, **options)
        if r == 0:
            with torch.no_grad():
                err = (model(ids).logits.double() - dense_logits.double()).abs().max().item()
            decode_tok_s(model, ids, 2)
        back_t.append(decode_tok_s(model, ids, new_tokens))
        if r < rounds - 1:
            restore_dense(model)
    return dense_t, back_t, err


def _split_backend_vs_dense(model, ids, new_tokens: int, layers: list[str], density: float) -> dict[str, Any]:
    """Per-token split of the converted model, then (restored) of the dense one, and the speed-up bounds."""

    back_b = decode_breakdown(model, ids, new_tokens, layers)
    restore_dense(model)
    dense_b = decode_breakdown(model, ids, new_tokens, layers)
    out = {
        "dense_breakdown_ms": {k: round(v, 3) for k, v in dense_b.items()},
        "backend_breakdown_ms": {k: round(v, 3) for k, v in back_b.items()},
        "sparse_layers_speedup": round(dense_b["layers_ms"] / max(back_b["layers_ms"], 1e-9), 3),
    }
    out.update({k: round(v, 3) for k, v in speedup_bounds(dense_b, density).items()})
    return out


def decode_bytes_per_token(model) -> int:
    """Bytes of weights one greedy decoding step reads: every linear layer's weight (a converted layer's
    packed storage, without a dense copy kept for prefill or restore) and the LM head; the input
    embedding contributes one row. The memory-bandwidth bound of decoding is the read bandwidth over
    this."""

    model = getattr(model, "module", model)
    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor) -> None:
        # each tensor once by its own address: tied weights share one, while the packed formats' tensors
        # are views of one buffer (backends.arena) at different addresses
        nonlocal total
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()

    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    for m in model.modules():
        if isinstance(m, SparseLinear):
            b = m.backend
            tensors = b.decode.storage_tensors() if hasattr(b, "decode") else b.storage_tensors()
            for t in tensors:
                add(t)
        elif isinstance(m, nn.Linear) or is_conv1d(m):
            add(m.weight)
    w = getattr(emb, "weight", None)  # an Int8Embedding reads the head's codes, counted above
    if w is not None and w.data_ptr() not in seen:
        total += w.shape[1] * w.element_size()  # one row
    return total
