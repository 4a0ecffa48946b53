"""Timing: whole-model greedy decoding (``auto``'s whole-model check in :mod:`hf_sparsity.inference`)
and round-robin medians of calls (``auto``'s per-layer choice, the bench library
:mod:`hf_sparsity.backends.bench`). Imports nothing of either, so neither imports the other.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def interleaved_ms(fns: dict[str, Any], repeats: int, inner: int = 1, device=None) -> dict[str, float]:
    """Median milliseconds per call of each function, timed round-robin (A, B, A, B, ...) to share
    the noise, after one warm-up call each (lazy init, caches, kernel build)."""
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
    return {k: statistics.median(v) for k, v in times.items()}
