"""Sampling and stopping for :func:`~hf_sparsity.inference.decoding.native_generate` between native steps.

transformers' logits processors, the draw and the stopping criteria run here on the step's logits, as
``generate``'s sampling loop runs them, with savings that leave the processed probabilities unchanged
(:class:`_Processing`): the usual sampling processors and the draw in one call into the kernel library
(``hfs_sample``, ``backends/csrc/sample.c``), the rest in torch; the sequence in a buffer written without a
torch operation a token (:class:`_Sequence`); the usual stopping criteria decided on Python ints
(:class:`_Stops`).
"""

from __future__ import annotations

import ctypes
import inspect

import torch
from torch import nn

from ..backends import _native
from ..hooks import logits_processor_fields, stopping_criterion_fields
from .loop import eos_ids, finished


class _Processing:
    """One generation's logits processors, run as ``LogitsProcessorList`` runs them in ``generate``'s loop
    (each called with the ids and the scores), with savings that leave the processed scores unchanged:

    * where the processors are the usual sampling list (:func:`_sampler`: the repetition penalty and the
      temperature, top-k or top-p, then temperature / top-k / top-p / min-p on its survivors) and the
      native kernels are loaded, :meth:`sample` computes them and the draw in one native call
      (``hfs_sample``) instead of about twenty torch operations, each slowed by the caches the decoding
      step left cold (0.5-0.9 ms a token on SmolLM2's vocabulary); a row the call leaves to torch (a NaN,
      fewer than top-k values above ``-inf``, ties past its room, a nucleus past its room) runs the
      processors as below;
    * the processors' signatures are read once, not once per token (``LogitsProcessorList`` inspects every
      processor at every call: about 0.3 ms a token for a sampling configuration);
    * the warpers after top-k that only read the scores' values (temperature, top-p, min-p, top-k:
      :func:`_survivor_warp`, with the default ``-inf`` filter) run on top-k's survivors instead of the
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
        self.listed, self.survivors, self.full_rows = processors, None, full_rows
        procs = list(processors)
        # a processor asking for more than (ids, scores) makes LogitsProcessorList raise: let it
        self.direct = all(len(inspect.signature(p.__call__).parameters) <= 2 for p in procs)
        self.head, self.tail = procs, []
        for i, p in enumerate(procs):
            if _kind(p) == "top_k":
                tail = procs[i + 1 :]
                if tail and _filters_to_minus_inf(p) and all(_survivor_warp(q) for q in tail):
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


_WARPS = {"temperature": 1, "top_k": 2, "top_p": 3, "min_p": 4}  # HFS_WARP_* in csrc/api.h
_MAX_TAIL = 4  # HFS_MAX_TAIL: warpers after top-k in one native call


class _Sampler(ctypes.Structure):  # hfs_sampler_t in csrc/api.h (tests/test_struct_mirrors.py)
    _fields_ = [
        *[(n, ctypes.c_int64) for n in ("vocab", "top_k", "cap", "seen_room", "n_tail")],
        ("tail_op", ctypes.c_int64 * _MAX_TAIL),
        ("tail_keep", ctypes.c_int64 * _MAX_TAIL),
        ("tail_value", ctypes.c_double * _MAX_TAIL),
        ("penalty", ctypes.c_float),
        ("temperature", ctypes.c_float),
        *[(n, ctypes.c_void_p) for n in ("idx", "order", "val", "heap", "saved", "work")],
        ("top_p", ctypes.c_double),
        ("top_p_keep", ctypes.c_int64),
    ]


_CANDIDATES = 1024
"""Room for top-k's survivors in the native call (more: top-k above it, or ties at its boundary): torch."""


class _NativeSampler:
    """``hfs_sample`` for one generation: its :class:`_Sampler` and buffers."""

    def __init__(self, lib, vocab: int, penalty, temperature, first, tail: list, seen_room: int) -> None:
        """``penalty``, ``temperature``, ``first``: :func:`~hf_sparsity.hooks.logits_processor_fields`'s
        fields (``None``: no such processor); ``tail``: :func:`_survivor_warp`'s tuples."""
        self.lib, self.skip, self.penalize = lib, 0, penalty is not None
        s = self.struct = _Sampler(vocab=vocab, cap=_CANDIDATES, seen_room=seen_room)
        if "top_k" in first:  # top-k; else top-p over the whole row
            s.top_k = min(first["top_k"], vocab)
        else:
            s.top_p, s.top_p_keep = first["top_p"], first["min_tokens_to_keep"]
        if penalty is not None:
            s.penalty, self.skip = penalty["penalty"], penalty["prompt_ignore_length"] or 0
        if temperature is not None:
            s.temperature = temperature["temperature"]
        s.n_tail = len(tail)
        for i, (op, value, keep) in enumerate(tail):
            s.tail_op[i], s.tail_value[i], s.tail_keep[i] = op, value, keep
        self.idx = torch.empty(_CANDIDATES, dtype=torch.int64)
        self.order = torch.empty(_CANDIDATES, dtype=torch.int64)
        self.val, self.heap = torch.empty(_CANDIDATES), torch.empty(_CANDIDATES)
        self.saved = torch.empty(max(seen_room, 1))
        self.work = torch.empty(_CANDIDATES, dtype=torch.float64)
        for name in ("idx", "order", "val", "heap", "saved", "work"):
            setattr(s, name, getattr(self, name).data_ptr())
        self.survivors = ctypes.c_int64(0)
        self._ref, self._survivors = ctypes.byref(s), ctypes.byref(self.survivors)

    def _seen(self, seq: _Sequence) -> tuple[int, int]:
        """(address, count) of the ids the repetition penalty reads (none without a penalty)."""
        skip = min(self.skip, seq.n)
        return (seq.buf.data_ptr() + 8 * skip, seq.n - skip) if self.penalize else (0, 0)

    def __call__(self, seq: _Sequence, logits: torch.Tensor, u: float) -> int:
        if seq.buf.dtype != torch.int64:  # the call reads the ids as int64
            return -1
        seen, count = self._seen(seq)
        return int(self.lib.hfs_sample(self._ref, logits.data_ptr(), seen, count, u, self._survivors))

    def top_k_screen(self, seq: _Sequence) -> tuple | None:
        """``NativeDecoder.step``'s ``top_k`` for the next draw: ``(k, penalty, seen address, count)`` where
        top-k is the first filter (the penalty as this call applies it), else ``None``."""
        s = self.struct
        if s.top_k <= 0 or seq.buf.dtype != torch.int64:
            return None
        return (s.top_k, s.penalty if self.penalize else 0.0, *self._seen(seq))


def _kind(proc) -> str | None:
    fields = logits_processor_fields(proc)
    return None if fields is None else fields[0]


def _sampler(procs, vocab: int, seen_room: int) -> _NativeSampler | None:
    """The native call for processors ``[repetition penalty?, temperature?, top-k or top-p, warpers on
    its survivors...]`` (``generate``'s order; at most :data:`_MAX_TAIL` after the first of top-k / top-p),
    or ``None`` (other processors, or no native kernels)."""
    read = [logits_processor_fields(p) for p in procs]
    kinds = [None if r is None else r[0] for r in read]
    # the first selector: top-k, or top-p where no top-k comes before it
    at = next((i for i, k in enumerate(kinds) if k in ("top_k", "top_p")), None)
    if at is None:
        return None
    first = read[at][1]
    if not _filters_to_minus_inf(procs[at]) or (kinds[at] == "top_k" and first["top_k"] > _CANDIDATES):
        return None
    tail = [_survivor_warp(q) for q in procs[at + 1 :]]
    if not all(tail):
        return None
    order = ["repetition_penalty", "temperature"]
    kinds = kinds[:at]
    if len(tail) > _MAX_TAIL or kinds not in ([], order[:1], order[1:], order):
        return None
    penalty = read[0][1] if kinds[:1] == order[:1] else None
    temperature = read[at - 1][1] if kinds[-1:] == order[1:] else None
    if penalty is not None:
        ignore = penalty["prompt_ignore_length"]
        if (ignore is not None and not isinstance(ignore, int)) or penalty["logits_indices"] is not None:
            return None
    lib = _native.load()
    if lib is None:
        return None
    return _NativeSampler(lib, vocab, penalty, temperature, first, tail, seen_room)


def _survivor_warp(proc) -> tuple[int, float, int] | None:
    """``(HFS_WARP_* code, value, min_tokens_to_keep)`` of a warper that reads only the scores' values and
    filters to ``-inf`` (temperature, top-k, top-p, min-p), which may run on top-k's survivors alone;
    ``None`` for any other processor."""
    read = logits_processor_fields(proc)
    if read is None or read[0] not in _WARPS or not _filters_to_minus_inf(proc):
        return None
    kind, fields = read
    return _WARPS[kind], fields[kind], fields.get("min_tokens_to_keep", 1)


def _filters_to_minus_inf(proc) -> bool:
    read = logits_processor_fields(proc)
    return read is None or read[1].get("filter_value", -float("inf")) == -float("inf")


class _Stops:
    """``generate``'s stopping criteria for one sequence: whether it is finished after token ``tok``. The
    usual list (the maximal length, end-of-sequence tokens) is decided on Python ints; any other criterion,
    or a length past the model's ``max_position_embeddings`` (where the length criterion logs a warning),
    runs the list itself."""

    def __init__(self, criteria, keep_scores: bool) -> None:
        self.criteria, self.keep_scores = criteria, keep_scores
        self.max_length, self.eos, self.past = None, set(), None
        self.plain = True
        for c in criteria:
            kind, fields = stopping_criterion_fields(c) or (None, {})
            if kind == "max_length":
                limit, past = fields["max_length"], fields["max_position_embeddings"]
                self.max_length = limit if self.max_length is None else min(self.max_length, limit)
                if past is not None:
                    self.past = past if self.past is None else min(self.past, past)
            elif kind == "eos":
                self.eos |= eos_ids(fields["eos_token_id"])
            else:
                self.plain = False

    def __call__(self, seq: _Sequence, tok: int, scores: list) -> bool:
        length = seq.n
        if not self.plain or (self.past is not None and length > self.past):
            return bool(self.criteria(seq.ids(), tuple(scores) if self.keep_scores else None).any())
        return finished(tok, length, self.eos, self.max_length)
