"""Decoding loops for batch-1 generation: the native step behind ``model.generate``, and a lean greedy loop.

``model.generate`` runs, per token, logits processors, stopping criteria, cache bookkeeping and input
preparation around the forward; and transformers' forward itself runs about two thousand small torch
operations per token of a 30-layer model. On a CPU, for a small model, that is milliseconds per token:
more than the sparse products themselves read from memory. Here:

* the **native step** (:class:`NativeDecoder`), for Llama-family models (Llama, Mistral, Qwen2) whose
  projections run on the native kernels (any ``SparseLinear`` on ``bitmask``, ``nm24``, ``csr``,
  ``native_dense`` or ``auto``; a plain float32 ``nn.Linear`` runs on the native dense GEMV in place): each
  new token is one call into the compiled kernel library, which runs every layer (norms, rotary embedding,
  attention over the cache, MLP, LM head) and leaves the last position's logits; a prompt of up to
  :data:`PROMPT_STEPS` tokens runs through the same call token by token, a longer one through the model's
  own forward (:mod:`~hf_sparsity.inference.native_step`; its names are re-exported here);
* :func:`native_generate`, the decoding loop ``model.generate`` and the text-generation ``pipeline`` run on
  the native step when passed as ``custom_generate`` (transformers' public extension point): greedy and
  sampling, with transformers' own logits processors, stopping criteria and streamers; ``generate``'s own
  loop (and one logged line naming why) where the native step does not run the call;
* :func:`greedy_decode`, a greedy loop without ``generate``'s preparation: the native step, or for every
  other model the **forward loop** (the model's forward with a KV cache, logits for the last position
  only, and an argmax).

All produce the tokens ``generate(do_sample=False)`` produces (the native step computes in float32 in
transformers' order of operations up to the order of sums, so its logits agree to rounding; the tests
compare tokens) and stop at the end-of-sequence token as ``generate`` does.

::

    from hf_sparsity.inference.decoding import greedy_decode, native_generate
    out = model.generate(**inputs, max_new_tokens=128, custom_generate=native_generate)
    out = model.generate(**inputs, do_sample=True, top_p=0.9, custom_generate=native_generate)
    out = greedy_decode(model, input_ids, max_new_tokens=128)   # [1, prompt + new] token ids
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from ..backends import measure
from ..hooks import generate_streamer, own_generate_loop
from ..utils import SparsityError, torch_threads
from .loop import decode_loop, eos_ids, forward_step, greedy_tokens
from .native_step import (  # noqa: F401 (re-exported)
    ARCHITECTURES,
    GPT2_ACTIVATIONS,
    PROMPT_STEPS,
    NativeDecoder,
    _refuse,
    native_step_reason,
)
from .sampling import _Processing, _Sequence, _Stops, _Uniforms

STEPS = ("auto", "native", "model")
"""``greedy_decode(step=...)``: ``native`` (the one-call native step; an error where it does not apply),
``model`` (the forward loop), ``auto`` (native where it applies, else the forward loop)."""


@torch.inference_mode()
def greedy_decode(
    model,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    eos_token_id: int | list[int] | None = None,
    on_token: Callable[[int], None] | None = None,
    step: str = "auto",
) -> torch.Tensor:
    """Greedy decoding of one prompt (``input_ids`` ``[1, n]``) for up to ``max_new_tokens`` tokens.

    Returns ``[1, n + generated]``; stops after an end-of-sequence token (``eos_token_id``, default the
    model's generation config; ``[]`` never stops early). ``on_token`` is called with each new token id
    as it is produced (e.g. to stream text). ``step``: see :data:`STEPS` (``auto``: the native step where
    :func:`native_step_reason` is ``None``).
    """
    if step not in STEPS:
        raise SparsityError(f"step={step!r}: use one of {', '.join(STEPS)}.")
    if input_ids.ndim != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
        raise SparsityError(
            f"greedy_decode takes one prompt, [1, n] token ids with n >= 1; got {list(input_ids.shape)}."
        )
    if max_new_tokens < 1:
        raise SparsityError("max_new_tokens must be at least 1.")
    if eos_token_id is None:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = eos_ids(eos_token_id)
    ids = input_ids.to(next(model.parameters()).device)
    length = int(ids.shape[1]) + max_new_tokens
    if step != "model":
        reason = native_step_reason(model, length)  # one walk over the layers per generation
        if step == "native":
            _refuse(reason)
        if reason is None:
            dec = NativeDecoder(model, check=False)
            try:
                first = int(dec.start(ids, length).argmax())
                step_fn = functools.partial(dec.step, greedy=True)  # only the id: the head may run screened
                new = greedy_tokens(first, step_fn, max_new_tokens, eos, on_token)
            finally:
                dec.close()
            return torch.cat([ids, torch.tensor([new], dtype=ids.dtype, device=ids.device)], dim=1)
    first, step_fn = forward_step(model, ids)
    new = greedy_tokens(first, step_fn, max_new_tokens, eos, on_token)
    return torch.cat([ids, torch.tensor([new], dtype=ids.dtype, device=ids.device)], dim=1)


measure.use_greedy_decode(greedy_decode)  # auto's whole-model check times decoding as users run it


# ------------------------------------------------------------------ model.generate(custom_generate=...)
NATIVE_STEPS = ("auto", "native")
"""``native_step=`` of :func:`native_generate`: ``auto`` (the native step where it runs this generation, else
transformers' own loop and one logged line naming why), ``native`` (an error where it does not run)."""

_CACHE_STEP = 256  # positions the native cache is allocated for beyond the prompt at first (it grows)

logger = logging.getLogger(__name__)


def _mode_name(generation_config) -> str:
    return generation_config.get_generation_mode().name.lower().replace("_", " ")


def generation_reason(model, input_ids: torch.Tensor, generation_config, model_kwargs: dict) -> str | None:
    """Why :func:`native_generate` cannot run this ``generate`` call on the native step (``None``: it can)."""
    from transformers.generation.configuration_utils import GenerationMode

    mode = generation_config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        return f"{_mode_name(generation_config)} (the native step runs greedy decoding and sampling)"
    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        return f"a batch of {input_ids.shape[0]} sequences (the native step decodes one)"
    if input_ids.shape[1] == 0 or model_kwargs.get("inputs_embeds") is not None:
        return "inputs_embeds instead of token ids"
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool((mask == 1).all()):
        return "padding in the attention mask"
    cache = model_kwargs.get("cache")
    if cache is not None and hasattr(cache, "get_seq_length") and int(cache.get_seq_length()) > 0:
        return "a cache passed in that already holds positions"
    if generation_config.return_dict_in_generate and (
        generation_config.output_attentions or generation_config.output_hidden_states
    ):
        return "output_attentions / output_hidden_states (scores and logits are returned)"
    return native_step_reason(model, int(generation_config.max_length or 0) or None)


@torch.no_grad()
def native_generate(
    model,
    input_ids: torch.Tensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    native_step: str = "auto",
    **model_kwargs,
):
    """The decoding loop of ``model.generate`` on the native step: pass it as ``custom_generate``.

    ::

        from hf_sparsity.inference.decoding import native_generate
        out = model.generate(**inputs, max_new_tokens=128, custom_generate=native_generate)
        out = model.generate(**inputs, do_sample=True, temperature=0.7, top_p=0.9,
                             custom_generate=native_generate)
        pipe = pipeline("text-generation", model=model, tokenizer=tok)
        pipe(prompt, custom_generate=native_generate)

    ``generate`` prepares everything as usual (generation config, logits processors, stopping criteria,
    ``max_new_tokens`` / ``eos_token_id``, the streamer's prompt) and hands the loop to this function, which
    computes each token's logits with one native call (:class:`NativeDecoder`) and then runs transformers'
    logits processors, the draw (the inverse of the cumulative probability at a uniform number from torch's
    generator) or the argmax, stopping criteria and streamer, as ``generate``'s sampling loop does: the usual
    sampling processors and the draw in a second native call (:class:`_Processing`), the rest in torch.
    Greedy gives ``generate``'s tokens; sampled runs draw from the same processed probabilities (up to float
    rounding). ``return_dict_in_generate`` returns the sequences, and the scores / logits when asked for.

    Where the native step does not run the call (:func:`generation_reason`: architecture, rope, dtype,
    backend, training mode, beam search, a batch, padding, ...) ``generate``'s own loop runs and one line
    is logged naming why; ``native_step="native"`` (a ``generate`` keyword) raises instead.
    """
    if native_step not in NATIVE_STEPS:
        raise SparsityError(f"native_step={native_step!r}: use one of {', '.join(NATIVE_STEPS)}.")
    if streamer is None:  # generate does not pass it on to a callable custom_generate
        streamer = generate_streamer()
    reason = generation_reason(model, input_ids, generation_config, model_kwargs)
    if synced_gpus:
        reason = "synced_gpus"
    if reason is not None:
        return _generate_loop(
            model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, streamer,
            native_step, reason, model_kwargs,
        )  # fmt: skip
    return _native_loop(model, input_ids, logits_processor, stopping_criteria, generation_config, streamer)


def _generate_loop(
    model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, streamer,
    native_step, reason, model_kwargs,
):  # fmt: skip
    """``generate``'s own loop for a call the native step does not run (``reason``), or the error
    ``native_step="native"`` asks for."""
    if native_step == "native":
        raise SparsityError(
            f"The native decoding step does not run this generation: {reason}. Drop "
            "native_step='native' (generate's own loop runs), or custom_generate altogether."
        )
    logger.warning("hf_sparsity: generate's own loop runs (not the native step): %s.", reason)
    loop = own_generate_loop(model, generation_config)
    if loop is None:
        raise SparsityError(
            f"{_mode_name(generation_config)} with custom_generate=native_generate: drop custom_generate."
        )
    return loop(
        input_ids,
        logits_processor,
        stopping_criteria,
        generation_config,
        synced_gpus,
        streamer,
        **model_kwargs,
    )


def _native_loop(model, input_ids, logits_processor, stopping_criteria, generation_config, streamer):
    """``generate``'s greedy / sampling loop with each token's logits from one native call."""
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    want_dict = generation_config.return_dict_in_generate
    keep_scores = want_dict and generation_config.output_scores
    keep_logits = want_dict and generation_config.output_logits
    scores, raw = [], []
    do_sample = generation_config.do_sample
    dec = NativeDecoder(model, check=False)
    n = int(input_ids.shape[1])
    limit = int(generation_config.max_length or n + _CACHE_STEP)
    logits = dec.start(input_ids.cpu(), min(limit, n + _CACHE_STEP), limit)
    vocab = int(logits.numel())
    processing = _Processing(logits_processor, keep_scores or not do_sample, vocab, seen_room=limit)
    # greedy without processors or scores: the argmax the native step computes (torch.argmax's)
    step_argmax = not do_sample and not keep_scores and not list(logits_processor)
    screened = step_argmax and not keep_logits  # the id only: the step may screen the LM head
    # sampling in the native call with top-k first: the step may screen the head for top-k's survivors
    sampler = processing.sampler if do_sample and not keep_scores and not keep_logits else None
    stops = _Stops(stopping_criteria, keep_scores)
    seq, uniform = _Sequence(input_ids, limit), _Uniforms()

    def choose(logits: torch.Tensor, best: int | None) -> int:
        """The next token from the step's logits (``best``: the step's own argmax)."""
        if keep_logits:
            raw.append(logits[None].clone())
        u = uniform() if do_sample else 0.0
        tok = processing.sample(seq, logits, u) if do_sample else best if step_argmax else None
        if tok is None:  # transformers' processors in torch
            step_scores = processing(seq.ids(), logits[None].clone())
            if keep_scores:
                scores.append(step_scores)
            tok = processing.draw(step_scores, u) if do_sample else int(torch.argmax(step_scores))
        elif keep_scores:
            scores.append(processing.scores(vocab))
        return tok

    def step(tok: int) -> int:
        top_k = sampler.top_k_screen(seq) if sampler is not None else None
        best = dec.step(tok, greedy=screened, top_k=top_k)  # first: a longer cache reallocates dec.logits
        return choose(dec.logits, best)

    def emit(tok: int) -> None:
        seq.append(tok)
        if streamer is not None:
            streamer.put(seq.buf[0, seq.n - 1 : seq.n])

    # The processors, sampling and stopping criteria run on one torch thread: on a vocabulary-sized row
    # torch splits an op over its OpenMP team, whose threads then spin on the cores the native step's own
    # pool needs (a 50%-sparse int8 SmolLM2 step took 1.2x as long after them); the step keeps its count.
    # A sequence of one stops at its first finished token, so generate's padding of finished sequences
    # (the pad token after the end-of-sequence token) never applies.
    try:
        with torch_threads(1):
            decode_loop(
                choose(logits, None),
                step,
                emit,
                lambda tok: stops(seq, tok, scores),
            )
    finally:
        dec.close()
    if streamer is not None:
        streamer.end()
    ids = seq.ids()
    if want_dict:
        return GenerateDecoderOnlyOutput(
            sequences=ids,
            scores=tuple(scores) if keep_scores else None,
            logits=tuple(raw) if keep_logits else None,
        )
    return ids


def native_generate_kwargs(native_step: str = "auto") -> dict:
    """The keywords that make ``model.generate`` / a text-generation ``pipeline`` call decode on the
    native step: ``model.generate(**inputs, **native_generate_kwargs())`` (:func:`native_generate`)."""
    if native_step not in NATIVE_STEPS:
        raise SparsityError(f"native_step={native_step!r}: use one of {', '.join(NATIVE_STEPS)}.")
    return {"custom_generate": native_generate, "native_step": native_step}
