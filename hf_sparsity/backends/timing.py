"""Timing whole-model greedy decoding: used by ``auto``'s whole-model check (:mod:`hf_sparsity.inference`)
and by the bench library (:mod:`hf_sparsity.backends.bench`). Imports nothing of either, so neither
imports the other.
"""

from __future__ import annotations

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
