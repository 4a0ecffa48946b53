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

import ctypes
import inspect
import logging
import sys
from collections.abc import Callable

import torch
from torch import nn

from ..utils import SparsityError, torch_threads
from .native_step import (  # noqa: F401 (re-exported)
    ARCHITECTURES,
    GPT2_ACTIVATIONS,
    PROMPT_STEPS,
    NativeDecoder,
    _refuse,
    native_step_reason,
)

STEPS = ("auto", "native", "model")
"""``greedy_decode(step=...)``: ``native`` (the one-call native step; an error where it does not apply),
``model`` (the forward loop), ``auto`` (native where it applies, else the forward loop)."""


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
    step: str = "auto",
) -> torch.Tensor:
    """Greedy decoding of one prompt (``input_ids`` ``[1, n]``) for up to ``max_new_tokens`` tokens.

    Returns ``[1, n + generated]``; stops after an end-of-sequence token (``eos_token_id``, default the
    model's generation config; ``[]`` never stops early). ``on_token`` is called with each new token id
    as it is produced (e.g. to stream text). ``step``: see :data:`STEPS` (``auto``: the native step where
    :func:`native_step_reason` is ``None``).
    """
    from transformers import DynamicCache

    if step not in STEPS:
        raise SparsityError(f"step={step!r}: use one of {', '.join(STEPS)}.")
    if input_ids.ndim != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
        raise SparsityError(
            f"greedy_decode takes one prompt, [1, n] token ids with n >= 1; got {list(input_ids.shape)}."
        )
    if max_new_tokens < 1:
        raise SparsityError("max_new_tokens must be at least 1.")
    eos = _eos_ids(model, eos_token_id)
    ids = input_ids.to(next(model.parameters()).device)
    length = int(ids.shape[1]) + max_new_tokens
    if step != "model":
        reason = native_step_reason(model, length)  # one walk over the layers per generation
        if step == "native":
            _refuse(reason)
        if reason is None:
            return NativeDecoder(model, check=False).generate(ids, max_new_tokens, eos, on_token)
    cache = DynamicCache(config=model.config)
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


# ------------------------------------------------------------------ model.generate(custom_generate=...)
NATIVE_STEPS = ("auto", "native")
"""``native_step=`` of :func:`native_generate`: ``auto`` (the native step where it runs this generation, else
transformers' own loop and one logged line naming why), ``native`` (an error where it does not run)."""

_CACHE_STEP = 256  # positions the native cache is allocated for beyond the prompt at first (it grows)

logger = logging.getLogger("hf_sparsity.decoding")  # the name it logged under before the move


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


def _caller_streamer():
    """The ``streamer`` transformers' ``generate`` was called with: its callable ``custom_generate`` is not
    handed the streamer (``generate`` gives it the prompt, then keeps it), so it is read from the caller's
    frame."""
    frame = sys._getframe(2)
    for _ in range(3):
        if frame is None:
            return None
        if frame.f_code.co_name == "generate" and "streamer" in frame.f_locals:
            return frame.f_locals["streamer"]
        frame = frame.f_back
    return None


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
    if streamer is None:
        streamer = _caller_streamer()
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
    from transformers.generation.utils import GENERATION_MODES_MAPPING

    if native_step == "native":
        raise SparsityError(
            f"The native decoding step does not run this generation: {reason}. Drop "
            "native_step='native' (generate's own loop runs), or custom_generate altogether."
        )
    logger.warning("hf_sparsity: generate's own loop runs (not the native step): %s.", reason)
    mode = generation_config.get_generation_mode()
    method = GENERATION_MODES_MAPPING.get(mode)
    if method not in ("_sample", "_beam_search"):
        raise SparsityError(
            f"{_mode_name(generation_config)} with custom_generate=native_generate: drop custom_generate."
        )
    extra = {"streamer": streamer} if method == "_sample" else {}
    return getattr(type(model), method)(
        model, input_ids, logits_processor, stopping_criteria, generation_config,
        synced_gpus=synced_gpus, **extra, **model_kwargs,
    )  # fmt: skip


class _Processing:
    """One generation's logits processors, run as ``LogitsProcessorList`` runs them in ``generate``'s loop
    (each called with the ids and the scores), with savings that leave the processed scores unchanged:

    * where the processors are the usual sampling list (:func:`_sampler`: the repetition penalty and the
      temperature, top-k, then temperature / top-k / top-p / min-p on its survivors) and the native kernels
      are loaded, :meth:`sample` computes them and the draw in one native call (``hfs_sample``) instead of
      about twenty torch operations, each slowed by the caches the decoding step left cold (0.5-0.9 ms a
      token on SmolLM2's vocabulary); a row the call leaves to torch (a NaN, fewer than top-k values above
      ``-inf``, ties past its room) runs the processors as below;
    * the processors' signatures are read once, not once per token (``LogitsProcessorList`` inspects every
      processor at every call: about 0.3 ms a token for a sampling configuration);
    * the warpers after top-k that only read the scores' values (temperature, top-p, min-p, top-k:
      :func:`_on_survivors`, with the default ``-inf`` filter) run on top-k's survivors instead of the
      whole vocabulary. Every token top-k removed is ``-inf`` and stays so; on the survivors these warpers
      compute what they compute on the whole row, up to the rounding of sums (top-p sorts 50 values instead
      of 49,152: 5 ms a token on SmolLM2's vocabulary). :attr:`survivors` holds their ids; a draw then
      samples among them (:meth:`draw`). The whole processed row (``-inf`` outside the survivors) is
      built only with ``full_rows`` (``output_scores``, greedy): a draw needs the survivors alone.

    Every draw, native or not, takes the first token whose cumulative probability (survivors in ascending
    id order) exceeds a uniform from torch's generator (:class:`_Uniforms`): a seed gives the same text
    whichever path a token took.
    """

    def __init__(
        self, processors, full_rows: bool = True, vocab: int | None = None, seen_room: int = 0
    ) -> None:
        from transformers.generation.logits_process import TopKLogitsWarper

        on_survivors = _on_survivors()
        self.listed, self.survivors, self.full_rows = processors, None, full_rows
        procs = list(processors)
        # a processor asking for more than (ids, scores) makes LogitsProcessorList raise: let it
        self.direct = all(len(inspect.signature(p.__call__).parameters) <= 2 for p in procs)
        self.head, self.tail = procs, []
        for i, p in enumerate(procs):
            if type(p) is TopKLogitsWarper:
                tail = procs[i + 1 :]
                if (
                    tail
                    and p.filter_value == -float("inf")
                    and all(type(q) in on_survivors and _filters_to_minus_inf(q) for q in tail)
                ):
                    self.head, self.tail = procs[: i + 1], tail
                break
        self.sampler = _sampler(procs, vocab, seen_room) if self.direct and vocab else None

    def sample(self, seq: _Sequence, logits: torch.Tensor, u: float) -> int | None:
        """The processors and the draw (uniform ``u``) in one native call on ``logits`` (float32 ``[vocab]``,
        left as they were); ``None``: not this generation's processors, or a row left to torch
        (:meth:`__call__`, :meth:`draw`). With ``full_rows``, :attr:`survivors` holds the processed
        survivors for :meth:`scores`."""
        self.survivors = None
        if self.sampler is None:
            return None
        tok = self.sampler(seq, logits, u)
        if tok < 0:
            return None
        if self.full_rows:
            m = self.sampler.survivors.value
            self.survivors = (self.sampler.idx[:m].clone(), self.sampler.val[None, :m].clone())
        return tok

    def scores(self, vocab: int) -> torch.Tensor:
        """The whole processed row of the last :meth:`sample`: ``-inf`` outside the survivors."""
        keep, sub = self.survivors
        return torch.full((1, vocab), -float("inf")).index_copy_(1, keep, sub)

    def __call__(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.survivors = None
        if not self.direct:
            return self.listed(ids, scores)
        for p in self.head:
            scores = p(ids, scores)
        if self.tail:
            keep = (scores[0] > -float("inf")).nonzero()[:, 0]  # top-k's survivors
            if keep.numel():
                sub = scores[:, keep]
                for p in self.tail:
                    sub = p(ids, sub)
                if self.full_rows:
                    scores = torch.full_like(scores, -float("inf")).index_copy_(1, keep, sub)
                self.survivors = (keep, sub)
        return scores

    def draw(self, scores: torch.Tensor, u: float) -> int:
        """The token of ``softmax(scores)`` (among the survivors where there are: the same distribution) whose
        cumulative probability first exceeds the uniform ``u``."""
        keep, sub = self.survivors if self.survivors is not None else (None, scores)
        cum = nn.functional.softmax(sub[0].double(), dim=-1).cumsum(0)
        i = min(
            int(torch.searchsorted(cum, torch.tensor([u], dtype=torch.float64), right=True)), len(cum) - 1
        )
        while i > 0 and cum[i] == cum[i - 1]:  # rounding left u at the sum: the last token with a probability
            i -= 1
        return int(keep[i]) if keep is not None else i


class _Uniforms:
    """Uniforms in [0, 1) from torch's generator (float64), 256 at a time, one a sampled token."""

    def __init__(self) -> None:
        self._left: list[float] = []

    def __call__(self) -> float:
        if not self._left:
            self._left = torch.rand(256, dtype=torch.float64).tolist()[::-1]
        return self._left.pop()


class _Sequence:
    """The prompt and the tokens so far, in a buffer written through numpy (no torch operation a token);
    :meth:`ids` views it as ``generate``'s ``[1, length]`` ids."""

    def __init__(self, ids: torch.Tensor, room: int) -> None:
        self.device, self.n = ids.device, int(ids.shape[1])
        self.buf = torch.empty(1, max(room, self.n + 1), dtype=ids.dtype)
        self.buf[:, : self.n] = ids.cpu()
        self.np = self.buf.numpy()

    def append(self, tok: int) -> None:
        if self.n == self.buf.shape[1]:
            self.buf = torch.cat([self.buf, torch.empty_like(self.buf)], dim=1)
            self.np = self.buf.numpy()
        self.np[0, self.n] = tok
        self.n += 1

    def ids(self) -> torch.Tensor:
        return self.buf[:, : self.n].to(self.device)


class _Sampler(ctypes.Structure):  # hfs_sampler_t in csrc/api.h (tests/test_struct_mirrors.py)
    _fields_ = [
        *[(n, ctypes.c_int64) for n in ("vocab", "top_k", "cap", "seen_room", "n_tail")],
        ("tail_op", ctypes.c_int64 * 4),
        ("tail_keep", ctypes.c_int64 * 4),
        ("tail_value", ctypes.c_double * 4),
        ("penalty", ctypes.c_float),
        ("temperature", ctypes.c_float),
        *[(n, ctypes.c_void_p) for n in ("idx", "order", "val", "heap", "fwork", "saved", "work")],
    ]


_CANDIDATES = 1024
"""Room for top-k's survivors in the native call (more: top-k above it, or ties at its boundary): torch."""


class _NativeSampler:
    """``hfs_sample`` for one generation: its :class:`_Sampler` and buffers."""

    def __init__(self, lib, vocab: int, penalty, temperature, top_k: int, tail: list, seen_room: int) -> None:
        self.lib, self.skip = lib, 0
        s = self.struct = _Sampler(vocab=vocab, top_k=min(top_k, vocab), cap=_CANDIDATES, seen_room=seen_room)
        if penalty is not None:
            s.penalty, self.skip = penalty.penalty, penalty.prompt_ignore_length or 0
        if temperature is not None:
            s.temperature = temperature.temperature
        s.n_tail = len(tail)
        for i, (op, value, keep) in enumerate(tail):
            s.tail_op[i], s.tail_value[i], s.tail_keep[i] = op, value, keep
        self.idx = torch.empty(_CANDIDATES, dtype=torch.int64)
        self.order = torch.empty(_CANDIDATES, dtype=torch.int64)
        self.val, self.heap, self.fwork = (torch.empty(_CANDIDATES) for _ in range(3))
        self.saved = torch.empty(max(seen_room, 1))
        self.work = torch.empty(_CANDIDATES, dtype=torch.float64)
        for name in ("idx", "order", "val", "heap", "fwork", "saved", "work"):
            setattr(s, name, getattr(self, name).data_ptr())
        self.survivors = ctypes.c_int64(0)
        self._ref, self._survivors = ctypes.byref(s), ctypes.byref(self.survivors)

    def __call__(self, seq: _Sequence, logits: torch.Tensor, u: float) -> int:
        if seq.buf.dtype != torch.int64 or seq.n > self.struct.seen_room:
            return -1
        seen = seq.buf.data_ptr() + 8 * min(self.skip, seq.n) if self.struct.penalty > 0 else 0
        count = seq.n - min(self.skip, seq.n) if self.struct.penalty > 0 else 0
        return int(self.lib.hfs_sample(self._ref, logits.data_ptr(), seen, count, u, self._survivors))


def _sampler(procs, vocab: int, seen_room: int) -> _NativeSampler | None:
    """The native call for processors ``[repetition penalty?, temperature?, top-k, warpers on survivors...]``
    (``generate``'s order; at most 4 after top-k), or ``None`` (other processors, or no native kernels)."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from ..backends import _native

    kinds = [type(p) for p in procs]
    if TopKLogitsWarper not in kinds:
        return None
    at = kinds.index(TopKLogitsWarper)
    head, top_k = procs[:at], procs[at]
    if top_k.filter_value != -float("inf") or top_k.top_k > _CANDIDATES:
        return None
    tail = []
    for q in procs[at + 1 :]:
        if not _filters_to_minus_inf(q):
            return None
        if type(q) is TemperatureLogitsWarper:
            tail.append((1, q.temperature, 1))
        elif type(q) is TopKLogitsWarper and q.top_k <= _CANDIDATES:
            tail.append((2, q.top_k, 1))
        elif type(q) is TopPLogitsWarper:
            tail.append((3, q.top_p, q.min_tokens_to_keep))
        elif type(q) is MinPLogitsWarper:
            tail.append((4, q.min_p, q.min_tokens_to_keep))
        else:
            return None
    order = [RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper]
    kinds = kinds[:at]
    if len(tail) > 4 or kinds not in ([], order[:1], order[1:], order):
        return None
    penalty = head[0] if kinds[:1] == order[:1] else None
    temperature = head[-1] if kinds[-1:] == order[1:] else None
    if penalty is not None:
        ignore = penalty.prompt_ignore_length
        if (ignore is not None and not isinstance(ignore, int)) or penalty.logits_indices is not None:
            return None
    lib = _native.load()
    if lib is None:
        return None
    return _NativeSampler(lib, vocab, penalty, temperature, top_k.top_k, tail, seen_room)


def _on_survivors() -> tuple[type, ...]:
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    return (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper)


def _filters_to_minus_inf(proc) -> bool:
    return getattr(proc, "filter_value", -float("inf")) == -float("inf")


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
    stops = _Stops(stopping_criteria, keep_scores)
    seq, uniform, best = _Sequence(input_ids, limit), _Uniforms(), None
    # The processors, sampling and stopping criteria run on one torch thread: on a vocabulary-sized row
    # torch splits an op over its OpenMP team, whose threads then spin on the cores the native step's own
    # pool needs (a 50%-sparse int8 SmolLM2 step took 1.2x as long after them); the step keeps its count.
    # A sequence of one stops at its first finished token, so generate's padding of finished sequences
    # (the pad token after the end-of-sequence token) never applies.
    try:
        with torch_threads(1):
            while True:
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
                seq.append(tok)
                if streamer is not None:
                    streamer.put(seq.buf[0, seq.n - 1 : seq.n])
                if stops(seq, tok, scores):
                    break
                best = dec.step(tok)
                logits = dec.logits
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


class _Stops:
    """``generate``'s stopping criteria for one sequence: whether it is finished after token ``tok``. The
    usual list (the maximal length, end-of-sequence tokens) is decided on Python ints; any other criterion,
    or a length past the model's ``max_position_embeddings`` (where the length criterion logs a warning),
    runs the list itself."""

    def __init__(self, criteria, keep_scores: bool) -> None:
        from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

        self.criteria, self.keep_scores = criteria, keep_scores
        self.max_length, self.eos, self.past = None, set(), None
        self.plain = True
        for c in criteria:
            if type(c) is MaxLengthCriteria:
                self.max_length = (
                    c.max_length if self.max_length is None else min(self.max_length, c.max_length)
                )
                if c.max_position_embeddings is not None:
                    self.past = (
                        c.max_position_embeddings
                        if self.past is None
                        else min(self.past, c.max_position_embeddings)
                    )
            elif type(c) is EosTokenCriteria:
                self.eos |= {int(e) for e in torch.as_tensor(c.eos_token_id).reshape(-1).tolist()}
            else:
                self.plain = False

    def __call__(self, seq: _Sequence, tok: int, scores: list) -> bool:
        length = seq.n
        if not self.plain or (self.past is not None and length > self.past):
            return bool(self.criteria(seq.ids(), tuple(scores) if self.keep_scores else None).any())
        return tok in self.eos or (self.max_length is not None and length >= self.max_length)


def native_generate_kwargs(native_step: str = "auto") -> dict:
    """The keywords that make ``model.generate`` / a text-generation ``pipeline`` call decode on the
    native step: ``model.generate(**inputs, **native_generate_kwargs())`` (:func:`native_generate`)."""
    if native_step not in NATIVE_STEPS:
        raise SparsityError(f"native_step={native_step!r}: use one of {', '.join(NATIVE_STEPS)}.")
    return {"custom_generate": native_generate, "native_step": native_step}
