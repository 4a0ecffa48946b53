"""The one decoding loop and the one end-of-sequence rule of every decoding path.

* :func:`decode_loop`: hand on a token, stop if the sequence is finished, else run the model on it and
  choose the next. ``greedy_decode`` (on the native step and on the forward loop), ``native_generate``'s
  loop on the native step and the timing harness's decode (``decode_breakdown``) all run it;
  :func:`greedy_tokens` is its greedy form.
* :func:`finished`: a sequence is finished after an end-of-sequence token (:func:`eos_ids`) or at its
  length limit, the rule ``generate``'s ``EosTokenCriteria`` and ``MaxLengthCriteria`` apply.
* :func:`forward_step`: the forward loop's step, the model's forward over a KV cache with the logits of
  the last position only, for models the native step does not run.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch


def eos_ids(value) -> set[int]:
    """End-of-sequence token ids as a set: ``None`` (none), an int, a list / tuple or a tensor of them."""
    if value is None:
        return set()
    return {int(e) for e in torch.as_tensor(value).reshape(-1).tolist()}


def finished(tok: int, length: int, eos: Collection[int], max_length: int | None) -> bool:
    """Whether a sequence is finished after token ``tok``: an end-of-sequence token, or ``length`` (what
    the limit counts, the token included) reached ``max_length`` (``None``: no limit)."""
    return tok in eos or (max_length is not None and length >= max_length)


def decode_loop(
    tok: int, step: Callable[[int], int], emit: Callable[[int], None], done: Callable[[int], bool]
) -> None:
    """From the first new token ``tok``: ``emit(tok)``, stop where ``done(tok)``, else ``tok = step(tok)``
    (the model run on ``tok``, and the next token chosen from its logits)."""
    while True:
        emit(tok)
        if done(tok):
            return
        tok = step(tok)


def greedy_tokens(
    first: int,
    step: Callable[[int], int],
    max_new_tokens: int,
    eos: Collection[int] = frozenset(),
    on_token: Callable[[int], None] | None = None,
) -> list[int]:
    """The new tokens of greedy decoding from the first one (``step(tok)``: the next greedy token), up to
    ``max_new_tokens`` and through the first end-of-sequence token; ``on_token`` sees each one."""
    new: list[int] = []

    def emit(tok: int) -> None:
        new.append(tok)
        if on_token is not None:
            on_token(tok)

    decode_loop(first, step, emit, lambda tok: finished(tok, len(new), eos, max_new_tokens))
    return new


def forward_step(model, ids: torch.Tensor) -> tuple[int, Callable[[int], int]]:
    """Run the prompt ``ids`` (``[1, n]``) through the model's forward with a fresh KV cache: the prompt's
    greedy token, and ``step(tok)`` -> the greedy token after ``tok`` (one forward over the cache, the
    logits of the last position only)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)

    def run(x: torch.Tensor) -> int:
        out = model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=1)
        return int(out.logits[0, -1].argmax())

    return run(ids), lambda tok: run(torch.tensor([[tok]], dtype=ids.dtype, device=ids.device))
