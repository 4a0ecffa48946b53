"""Language-model losses: Pile-style validation loss and WikiText-103 adjusted perplexity.

Both score a token stream in windows of the model's context and sum the next-token
negative log-likelihood (NLL) in float32, the way Megatron's zero-shot evaluation does
(``tasks/zeroshot_gpt``): a window of ``context + 1`` tokens gives ``context``
predictions; every token after the first is predicted exactly once.
"""

from __future__ import annotations

import glob
import io
import json
import math
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..modeling import context_length
from ..utils import SparsityError


def model_context(model: nn.Module, default: int = 2048) -> int:
    """The model's context length from its config (``max_position_embeddings`` and friends)."""
    return context_length(getattr(model, "config", None), default)


def _device_of(model: nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def safe_exp(x: float) -> float:
    """``exp`` that returns ``inf`` instead of raising on overflow."""
    try:
        return math.exp(x)
    except OverflowError:
        return float("inf")


@torch.no_grad()
def score_windows(model: nn.Module, windows: torch.Tensor, first_scored: int = 0) -> tuple[float, int]:
    """Sum of next-token NLL over a batch of token windows ``(B, L+1)``.

    The model sees ``windows[:, :-1]``; targets are ``windows[:, 1:]``. Only target
    positions ``>= first_scored`` count (the earlier ones are context already scored
    by a previous, overlapping window). Returns ``(nll_sum, targets_counted)``.
    """
    windows = windows.to(_device_of(model))
    inputs, targets = windows[:, :-1], windows[:, 1:]
    logits = model(input_ids=inputs, use_cache=False).logits
    if first_scored:
        logits, targets = logits[:, first_scored:], targets[:, first_scored:]
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="sum")
    return float(nll), targets.numel()


def _progress(progress: bool, desc: str, total: int | None = None):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="tok", unit_scale=True, disable=not progress, leave=False)


# ----------------------------------------------------------------------------- Pile-style loss
def resolve_corpus_files(data: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """Expand a corpus spec: a ``.jsonl``/``.jsonl.zst`` file, a folder of them, a glob, or a list."""
    items = [data] if isinstance(data, (str, os.PathLike)) else list(data)
    files: list[Path] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            found = sorted(q for q in p.iterdir() if q.name.endswith((".jsonl", ".jsonl.zst", ".json")))
        elif p.is_file():
            found = [p]
        else:
            found = [Path(x) for x in sorted(glob.glob(str(item)))]
        if not found:
            raise SparsityError(
                f"No Pile-format corpus at {str(item)!r}. Pass a .jsonl or .jsonl.zst file of "
                '{"text": ..., "meta": ...} lines, a folder of them, or a glob.'
            )
        files.extend(found)
    return files


def _open_text(path: Path) -> io.TextIOBase:
    if path.name.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise SparsityError(
                f"{path} is zstd-compressed; install zstandard (pip install 'hf_sparsity[eval]')."
            ) from None
        raw = open(path, "rb")
        reader = zstandard.ZstdDecompressor().stream_reader(raw, closefd=True)
        return io.TextIOWrapper(reader, encoding="utf-8")
    return open(path, encoding="utf-8")


def iter_documents(
    data: str | os.PathLike | Sequence[str | os.PathLike], limit: int | None = None
) -> Iterator[str]:
    """Stream the ``text`` field of Pile-format jsonl lines (``.jsonl.zst`` too), at most ``limit``
    documents."""
    n = 0
    for path in resolve_corpus_files(data):
        with _open_text(path) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if limit is not None and n >= limit:
                    return
                try:
                    text = json.loads(line)["text"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise SparsityError(
                        f"{path}:{lineno} is not a Pile-format line (a JSON object with a 'text' field)."
                    ) from None
                n += 1
                yield text


def iter_windows(
    docs: Iterable[str], tokenizer: Any, context: int, eos_id: int | None
) -> Iterator[list[int]]:
    """Join tokenized documents, each followed by EOS, and cut non-overlapping windows.

    Each window holds ``context + 1`` tokens and shares its first token with the end of
    the previous one, so every token after the very first is a target exactly once. The
    last window may be shorter.
    """
    buf: list[int] = []
    batch: list[str] = []

    def flush():
        enc = tokenizer(batch, add_special_tokens=False, verbose=False)["input_ids"]
        for ids in enc:
            buf.extend(ids)
            if eos_id is not None:
                buf.append(eos_id)
        batch.clear()

    for doc in docs:
        batch.append(doc)
        if len(batch) >= 32:
            flush()
        while len(buf) >= context + 1:
            yield buf[: context + 1]
            del buf[:context]
    if batch:
        flush()
    while len(buf) >= context + 1:
        yield buf[: context + 1]
        del buf[:context]
    if len(buf) >= 2:
        yield buf


def pile_loss(
    model: nn.Module,
    tokenizer: Any,
    data: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    context: int | None = None,
    batch_size: int = 4,
    limit: int | None = None,
    max_tokens: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Pile-style validation loss: token-weighted mean cross-entropy over a Pile-format corpus.

    Documents (``{"text", "meta"}`` jsonl, optionally ``.zst``) are tokenized without
    special tokens, each followed by the tokenizer's EOS, concatenated, and cut into
    non-overlapping windows of ``context`` tokens (default: the model's context).

    Args:
        limit: score only the first ``limit`` documents.
        max_tokens: stop after about this many scored tokens (whole batches).

    Returns:
        ``{"loss", "perplexity", "tokens", "windows", "documents", "context"}`` where
        ``loss`` is the summed NLL divided by ``tokens`` (targets scored).
    """
    # Long by design: a streaming loop with its own batching; split, it would pass half its state around.
    context = int(context or model_context(model))
    if context < 1:
        raise SparsityError(f"--context must be a positive number of tokens, got {context}.")
    eos_id = getattr(tokenizer, "eos_token_id", None)
    counter = {"docs": 0}

    def counted(docs):
        for d in docs:
            counter["docs"] += 1
            yield d

    was_training = model.training
    model.eval()
    total = 0.0
    tokens = windows = 0
    pending: list[list[int]] = []
    bar = _progress(progress, "pile loss", max_tokens)

    def run(batch: list[list[int]]):
        nonlocal total, tokens, windows
        nll, n = score_windows(model, torch.tensor(batch, dtype=torch.long))
        total += nll
        tokens += n
        windows += len(batch)
        bar.update(n)

    try:
        for window in iter_windows(counted(iter_documents(data, limit)), tokenizer, context, eos_id):
            if max_tokens is not None and tokens >= max_tokens:
                break
            if len(window) != context + 1:  # the short tail gets its own forward
                if pending:
                    run(pending)
                    pending = []
                run([window])
                continue
            pending.append(window)
            if len(pending) == batch_size:
                run(pending)
                pending = []
        if pending and (max_tokens is None or tokens < max_tokens):
            run(pending)
    finally:
        bar.close()
        model.train(was_training)
    if tokens == 0:
        raise SparsityError("The corpus produced no tokens to score; check the file and --limit.")
    loss = total / tokens
    return {
        "loss": loss,
        "perplexity": safe_exp(loss),
        "tokens": tokens,
        "windows": windows,
        "documents": counter["docs"],
        "context": context,
    }


# ----------------------------------------------------------------------------- WikiText-103
def wikitext_detokenize(text: str) -> str:
    """Undo WikiText's word-level tokenization (Megatron's ``wikitext_detokenizer``, as lm-eval also uses
    it)."""
    s = text
    # contractions
    s = s.replace("s '", "s'")
    s = re.sub(r"/' [0-9]/", r"/'[0-9]/", s)
    # number separators
    s = s.replace(" @-@ ", "-").replace(" @,@ ", ",").replace(" @.@ ", ".")
    # punctuation
    for p in (":", ";", ".", "!", "?", ","):
        s = s.replace(f" {p} ", f"{p} ")
    # brackets and quotes
    s = re.sub(r"\(\s*([^\)]*?)\s*\)", r"(\1)", s)
    s = re.sub(r"\[\s*([^\]]*?)\s*\]", r"[\1]", s)
    s = re.sub(r"{\s*([^}]*?)\s*}", r"{\1}", s)
    s = re.sub(r"\"\s*([^\"]*?)\s*\"", r'"\1"', s)
    s = re.sub(r"'\s*([^']*?)\s*'", r"'\1'", s)
    # miscellaneous
    s = s.replace("= = = =", "====").replace("= = =", "===").replace("= =", "==")
    s = s.replace(" " + chr(176) + " ", chr(176))
    s = s.replace(" \n", "\n").replace("\n ", "\n")
    s = s.replace(" N ", " 1 ")
    s = s.replace(" 's", "'s")
    return s


def count_original_tokens(text: str) -> int:
    """Megatron's count of WikiText's original tokens: ``len(text.strip().split(" "))``.

    Splitting on single spaces counts each line break of the word-level file as a token,
    as WikiText's own ``<eos>`` does.
    """
    return len(text.strip().split(" "))


def adjusted_perplexity(total_nll: float, num_model_tokens: int, num_original_tokens: int) -> float:
    """Megatron's adjusted perplexity: ``exp(total_nll / (num_original_tokens - 1))``.

    ``total_nll`` is summed over the ``num_model_tokens - 1`` predicted model tokens; the
    per-token loss is rescaled by ``token_ratio = (num_model_tokens - 1) /
    (num_original_tokens - 1)`` so models with different tokenizers are compared per
    original word-level token.
    """
    if num_model_tokens < 2 or num_original_tokens < 2:
        raise SparsityError("Adjusted perplexity needs at least two model tokens and two original tokens.")
    val_loss = total_nll / (num_model_tokens - 1)
    token_ratio = (num_model_tokens - 1) / (num_original_tokens - 1)
    return safe_exp(val_loss * token_ratio)


def sliding_window_nll(
    model: nn.Module,
    ids: Sequence[int],
    *,
    context: int,
    stride: int | None = None,
    batch_size: int = 4,
    progress: bool = True,
) -> tuple[float, int]:
    """Summed NLL of ``ids[1:]`` with Megatron's overlapping evaluation.

    Window ``k`` holds ``ids[k*stride : k*stride + context + 1]``; window 0 scores all
    its targets, every later window only its last ``stride`` targets (the earlier ones
    serve as context). ``stride = context`` (the default) means no overlap. Returns
    ``(nll_sum, targets_scored)``; ``targets_scored == len(ids) - 1``.
    """
    stride = int(stride or context)
    if not 1 <= stride <= context:
        raise SparsityError(f"stride must be in [1, context={context}], got {stride}.")
    n_targets = len(ids) - 1
    if n_targets < 1:
        raise SparsityError("Nothing to score: the text tokenized to fewer than two tokens.")
    ids_t = torch.as_tensor(list(ids), dtype=torch.long)
    jobs = []  # (start, first_scored, length)
    k = 0
    while True:
        start = k * stride
        end = min(start + context + 1, len(ids))
        first = 0 if k == 0 else context - stride
        if end - start - 1 <= first:  # nothing new to score
            break
        jobs.append((start, first, end - start))
        if end == len(ids):
            break
        k += 1
    total = 0.0
    scored = 0
    bar = _progress(progress, "wikitext-103", n_targets)
    was_training = model.training
    model.eval()
    try:
        i = 0
        while i < len(jobs):
            # batch consecutive windows of equal length and first_scored
            j = i
            while j < len(jobs) and j - i < batch_size and jobs[j][1:] == jobs[i][1:]:
                j += 1
            length, first = jobs[i][2], jobs[i][1]
            batch = torch.stack([ids_t[s : s + length] for s, _, _ in jobs[i:j]])
            nll, n = score_windows(model, batch, first_scored=first)
            total += nll
            scored += n
            bar.update(n)
            i = j
    finally:
        bar.close()
        model.train(was_training)
    assert scored == n_targets, (scored, n_targets)
    return total, scored


def first_articles(text: str, n: int) -> str:
    """The first ``n`` articles of a WikiText file (an article starts at a `` = Title = `` line)."""
    lines = text.splitlines(keepends=True)
    starts = [i for i, ln in enumerate(lines) if re.match(r"^ = [^=].* = \s*$", ln)]
    if len(starts) <= n:
        return text
    return "".join(lines[: starts[n]])


def wikitext103_perplexity(
    model: nn.Module,
    tokenizer: Any,
    path: str | os.PathLike | None = None,
    *,
    text: str | None = None,
    context: int | None = None,
    stride: int | None = None,
    batch_size: int = 4,
    limit: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """WikiText-103 perplexity, adjusted to the original word-level tokens, as Megatron computes it.

    Reads the word-level file (``wiki.test.tokens``) whole, counts its original tokens
    (:func:`count_original_tokens`), detokenizes it (:func:`wikitext_detokenize`),
    tokenizes it with the model's tokenizer (no special tokens), scores it with
    :func:`sliding_window_nll`, and reports

    * ``perplexity``: ``exp(nll / (model_tokens - 1))``, the plain token-level perplexity;
    * ``adjusted_perplexity``: ``exp(nll / (original_tokens - 1))`` (:func:`adjusted_perplexity`).

    Args:
        stride: new tokens scored per window (Megatron's ``--overlapping-eval``); default
            ``context``, i.e. no overlap. Smaller means more context per token, slower.
        limit: score only the first ``limit`` articles.
    """
    if text is None:
        if path is None:
            raise SparsityError(
                "wikitext103 needs the word-level file: pass wiki.test.tokens (or --data-dir)."
            )
        p = Path(path)
        if not p.is_file():
            raise SparsityError(
                f"No WikiText-103 file at {str(p)!r}. Pass the word-level wiki.test.tokens file "
                "(the one with <unk> and @-@), e.g. DATA_DIR/text/wikitext-103/wiki.test.tokens."
            )
        text = p.read_bytes().decode("utf-8")
    if limit is not None:
        text = first_articles(text, limit)
    num_original = count_original_tokens(text)
    ids = tokenizer(wikitext_detokenize(text), add_special_tokens=False, verbose=False)["input_ids"]
    context = int(context or model_context(model))
    total, scored = sliding_window_nll(
        model, ids, context=context, stride=stride, batch_size=batch_size, progress=progress
    )
    loss = total / scored
    return {
        "loss": loss,
        "perplexity": safe_exp(loss),
        "adjusted_perplexity": adjusted_perplexity(total, len(ids), num_original),
        "token_ratio": (len(ids) - 1) / (num_original - 1),
        "model_tokens": len(ids),
        "original_tokens": num_original,
        "context": context,
        "stride": int(stride or context),
    }
