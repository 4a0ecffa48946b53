"""A lean greedy decoding loop: the model's forward and an argmax per token, nothing else.

``model.generate`` runs, per token, logits processors, stopping criteria, cache bookkeeping and input
preparation around the forward; for a small model on a CPU that is a visible part of each token. This
loop calls the forward directly with a KV cache, computes logits for the last position only, and takes
the argmax: for batch-1 greedy decoding it produces the tokens ``generate(do_sample=False)`` produces
(it stops at the end-of-sequence token as ``generate`` does).

::

    from hf_sparsity.decoding import greedy_decode
    out = greedy_decode(model, input_ids, max_new_tokens=128)   # [1, prompt + new] token ids
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .utils import SparsityError


def _eos_ids(model, eos_token_id) -> set[int]:
    if eos_token_id is None:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos_token_id is None:
        return set()
    return {int(e) for e in (eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id])}


@torch.inference_mode()
def greedy_decode(
    model,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    eos_token_id: int | list[int] | None = None,
    on_token: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """Greedy decoding of one prompt (``input_ids`` ``[1, n]``) for up to ``max_new_tokens`` tokens.

    Returns ``[1, n + generated]``; stops after an end-of-sequence token (``eos_token_id``, default the
    model's generation config). ``on_token`` is called with each new token id as it is produced (e.g.
    to stream text).
    """
    from transformers import DynamicCache

    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise SparsityError(f"greedy_decode takes one prompt, [1, n] token ids; got {list(input_ids.shape)}.")
    if max_new_tokens < 1:
        raise SparsityError("max_new_tokens must be at least 1.")
    eos = _eos_ids(model, eos_token_id)
    cache = DynamicCache(config=model.config)
    ids = input_ids.to(next(model.parameters()).device)
    out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    new: list[torch.Tensor] = []
    for i in range(max_new_tokens):
        nxt = out.logits[:, -1, :].argmax(-1, keepdim=True)
        new.append(nxt)
        tok = int(nxt)
        if on_token is not None:
            on_token(tok)
        if tok in eos or i == max_new_tokens - 1:
            break
        out = model(input_ids=nxt, cache=cache, use_cache=True, logits_to_keep=1)
    return torch.cat([ids, *new], dim=1)
