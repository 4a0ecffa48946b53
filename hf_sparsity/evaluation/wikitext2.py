"""The literature's WikiText-2 perplexity, as the Wanda and SparseGPT code computes it.

Protocol (``locuslab/wanda`` ``lib/eval.py`` ``eval_ppl_wikitext``; SparseGPT ``datautils.py``):

* the rows of the WikiText-2 *raw* test split as the HF ``wikitext`` builder makes them (one
  row per line of ``wiki.test.raw``, the newline kept, blank lines as ``""``), joined with
  ``"\\n\\n"`` and tokenized once;
* cut into ``floor(tokens / seqlen)`` non-overlapping windows (the tail is dropped);
* perplexity = ``exp`` of the mean over windows of each window's mean next-token loss
  (``seqlen - 1`` predictions per window).

The figure depends on ``seqlen`` (and the tokenizer), and is not the WikiText-103 adjusted
perplexity of the ``wikitext103`` suite, which normalizes by the original word count.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..utils import SparsityError
from .perplexity import _device_of, model_context, safe_exp

DEFAULT_WIKITEXT2 = "text/wikitext-2-raw/wiki.test.raw"


def wikitext2_rows(path: str | os.PathLike) -> list[str]:
    """The rows the HF ``wikitext`` builder yields for ``wiki.test.raw``: lines with their newline,
    blanks as ``""``."""
    path = Path(path)
    if not path.is_file():
        raise SparsityError(
            f"No WikiText-2 file at {str(path)!r}. Pass --data-dir DIR holding {DEFAULT_WIKITEXT2}."
        )
    with open(path, encoding="utf-8", newline="") as f:
        return [row if row.strip() else "" for row in f]


def wikitext2_windows(tokenizer, rows: list[str], seqlen: int) -> torch.Tensor:
    """``(floor(tokens / seqlen), seqlen)`` token ids of ``"\\n\\n".join(rows)``, tokenized once."""
    if seqlen < 2:
        raise SparsityError(f"--seqlen {seqlen}: a window needs at least 2 tokens.")
    ids = tokenizer("\n\n".join(rows), return_tensors="pt")["input_ids"][0]
    n = ids.numel() // seqlen
    if n == 0:
        raise SparsityError(f"The text has {ids.numel()} tokens, fewer than one window of {seqlen}.")
    return ids[: n * seqlen].reshape(n, seqlen)


@torch.no_grad()
def window_losses(model: nn.Module, windows: torch.Tensor, batch_size: int = 1, progress: bool = False):
    """Mean next-token loss of each window (float64 list)."""
    from tqdm.auto import tqdm

    out = []
    bar = tqdm(total=windows.shape[0], desc="wikitext2", unit="window", disable=not progress, leave=False)
    for batch in windows.split(batch_size):
        batch = batch.to(_device_of(model))
        logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()
        nll = F.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none")
        out.extend(nll.mean(dim=1).double().tolist())
        bar.update(batch.shape[0])
    bar.close()
    return out


def wikitext2_perplexity(
    model: nn.Module,
    tokenizer,
    path: str | os.PathLike,
    seqlen: int | None = None,
    max_windows: int | None = None,
    batch_size: int = 1,
    progress: bool = False,
) -> dict[str, Any]:
    """WikiText-2 perplexity by the Wanda / SparseGPT protocol; ``seqlen`` defaults to the model's context."""
    seqlen = seqlen or model_context(model)
    windows = wikitext2_windows(tokenizer, wikitext2_rows(path), seqlen)
    total = windows.shape[0]
    if max_windows is not None:
        if max_windows < 1:
            raise SparsityError(f"--max-windows {max_windows} must be at least 1.")
        windows = windows[:max_windows]
    losses = window_losses(model, windows, batch_size=batch_size, progress=progress)
    mean = sum(losses) / len(losses)
    return {
        "perplexity": safe_exp(mean),
        "mean_loss": mean,
        "seqlen": seqlen,
        "windows": len(losses),
        "windows_available": total,
        "protocol": (
            "wanda/sparsegpt: rows joined with \\n\\n, floor(tokens/seqlen) windows, exp(mean window loss)"
        ),
    }


def format_wikitext2(result: dict[str, Any]) -> str:
    return (
        f"wikitext2 perplexity {result['perplexity']:.4f} (seqlen {result['seqlen']}, "
        f"{result['windows']} of {result['windows_available']} windows, mean loss {result['mean_loss']:.6f})"
    )
