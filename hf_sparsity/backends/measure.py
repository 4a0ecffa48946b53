"""The measurements ``auto`` makes while converting a model: round-robin timings of calls (its per-layer
choice), greedy decoding speed (its whole-model check) and the machine's memory read bandwidth (its cost
model). The benchmark tools use them too; this module imports nothing of theirs.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from ..utils import torch_threads
from . import _native
from .arena import huge_buffer, pack_backends
from .registry import get_backend


def decode_tok_s(model, ids: torch.Tensor, new_tokens: int, **generate_kwargs: Any) -> float:
    """Tokens/s of greedy ``generate`` producing exactly ``new_tokens`` tokens after the prompt
    (``generate_kwargs``: e.g. :func:`hf_sparsity.inference.compiled_generate_kwargs`)."""
    t = time.perf_counter()
    with torch.inference_mode():  # as inference should run; dense and backend alike
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=getattr(model.generation_config, "pad_token_id", None) or 0,
            **generate_kwargs,
        )
    return new_tokens / (time.perf_counter() - t)


_greedy_decode = None
"""Greedy decoding as ``hf_sparsity generate`` runs it
(:func:`hf_sparsity.inference.decoding.greedy_decode`, which registers itself with
:func:`use_greedy_decode` when the inference package loads: the backends do not import it)."""


def use_greedy_decode(fn) -> None:
    """Register the decoding loop :func:`step_tok_s` times (``fn(model, ids, new_tokens, eos_token_id=,
    on_token=)``)."""
    global _greedy_decode
    _greedy_decode = fn


def step_tok_s(model, ids: torch.Tensor, new_tokens: int) -> float:
    """Tokens/s of greedy decoding as ``hf_sparsity generate`` runs it (the registered
    :func:`~hf_sparsity.inference.decoding.greedy_decode`: the native step where it runs the model, else the
    forward loop), from the first new token to the last: the prompt and the decoder's set-up are left out.
    ``new_tokens`` (at least 2) are produced whatever the model's end-of-sequence token. Before the inference
    package has loaded, :func:`decode_tok_s` (``generate``) times it."""
    if new_tokens < 2:
        raise ValueError(f"new_tokens={new_tokens}: timing between the first and the last token needs 2.")
    if _greedy_decode is None:
        return decode_tok_s(model, ids, new_tokens)
    stamps: list[float] = []
    _greedy_decode(
        model, ids, new_tokens, eos_token_id=[], on_token=lambda _tok: stamps.append(time.perf_counter())
    )
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def interleaved_ms(
    fns: dict[str, Any], repeats: int, inner: int = 1, device=None, stat: str = "median"
) -> dict[str, float]:
    """Milliseconds per call of each function, timed round-robin (A, B, A, B, ...) to share the noise,
    after one warm-up call each (lazy init, caches, kernel build): the median over ``repeats`` rounds, or
    with ``stat="min"`` the fastest round (noise from other work only ever adds time)."""
    device = torch.device(device or "cpu")
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for k, fn in fns.items():
            _sync(device)
            t = time.perf_counter()
            for _ in range(inner):
                fn()
            _sync(device)
            times[k].append((time.perf_counter() - t) * 1e3 / inner)
    pick = min if stat == "min" else statistics.median
    return {k: pick(v) for k, v in times.items()}


_BANDWIDTH: dict[int, float] = {}


def read_bandwidth_gbs(
    nbytes: int = 256 << 20, repeats: int = 5, threads: int | None = None, fresh: bool = False
) -> float:
    """The memory read bandwidth in GB/s with ``threads`` (default ``torch.get_num_threads()``): a
    STREAM-like sum over a float32 buffer of ``nbytes`` (larger than the last-level cache; on transparent
    huge pages where available, as :func:`~hf_sparsity.backends.arena.pack_weights` puts the weights),
    the fastest of ``repeats`` passes. Measured once per process and thread count (``fresh=True``:
    measured again; on a shared machine it moves with the neighbours' load)."""
    nt = threads or torch.get_num_threads()
    if nt in _BANDWIDTH and not fresh:
        return _BANDWIDTH[nt]
    with torch_threads(nt):
        # on huge pages where the kernel gives them, as the packed weights are (backends.arena)
        buf = huge_buffer(nbytes // 4 * 4).view(torch.float32)
        buf.fill_(1.0)  # fault the pages in
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - t)
    _BANDWIDTH[nt] = nbytes / best / 1e9
    return _BANDWIDTH[nt]


_KERNEL_READ: dict[str, Any] = {}


def kernel_read_gbs(
    threads: int | None = None, repeats: int = 5, rows: int = 16384, cols: int = 8192
) -> float | None:
    """The read rate in GB/s of the native bitmask kernel (int8 values, half the weights kept) on a
    batch-1 product over a weight of ``rows x cols`` (84 MB by default, beyond the last-level cache of most
    machines), the fastest of ``repeats`` calls with ``threads``; ``None`` without the native kernels.
    The kernel prefetches its streams in software, which on some machines reads faster than
    :func:`read_bandwidth_gbs`'s sum: a bound on decoding speed takes the faster of the two."""
    if _native.load() is None:
        return None
    key = f"{rows}x{cols}"
    if key not in _KERNEL_READ:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(rows, cols, generator=g)
        _KERNEL_READ.clear()
        _KERNEL_READ[key] = get_backend("bitmask").from_dense(
            w, torch.rand(rows, cols, generator=g) < 0.5, values="int8"
        )
        pack_backends([_KERNEL_READ[key]])  # where a converted model's weights live
    weight = _KERNEL_READ[key]
    nbytes = sum(t.numel() * t.element_size() for t in weight.storage_tensors())
    x = torch.randn(1, cols)
    with torch_threads(threads or torch.get_num_threads()):
        weight.linear(x)
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            weight.linear(x)
            best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def peak_read_gbs(threads: int | None = None, fresh: bool = False) -> float:
    """The faster of :func:`read_bandwidth_gbs` (a sum) and :func:`kernel_read_gbs` (the bitmask kernel's
    prefetched read): the read rate a decoding bound divides by. A bound from the slower one alone would
    let a product run "above" it."""
    return max(read_bandwidth_gbs(threads=threads, fresh=fresh), kernel_read_gbs(threads) or 0.0)
