"""Calibration windows for one-shot pruning, sampled exactly as the Wanda / SparseGPT code samples C4.

``locuslab/wanda`` ``lib/data.py`` (``get_c4``)::

    random.seed(seed)
    for _ in range(nsamples):
        while True:
            i = random.randint(0, len(docs) - 1)
            enc = tokenizer(docs[i]["text"])
            if len(enc) > seqlen: break
        i = random.randint(0, len(enc) - seqlen - 1)
        window = enc[i : i + seqlen]

Documents: the rows of a JSONL file in file order (``text_column``), the blank-line-separated
paragraphs of a ``.txt`` file, or the ``train`` split of a dataset name (``datasets``, needs
the hub or its cache).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import torch

from ..utils import SparsityError


def read_documents(source: str | os.PathLike, text_column: str = "text") -> list[str]:
    """The calibration documents of a ``.jsonl`` / ``.txt`` file, or of a dataset name's train split."""
    path = Path(source)
    if path.is_file():
        try:
            if path.suffix in (".jsonl", ".json"):
                return _read_jsonl(path, text_column)
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise SparsityError(
                f"Calibration file {str(path)!r} is not UTF-8 text (byte {e.start} cannot be decoded): give "
                f"a .jsonl file (one JSON object per line) or a .txt file."
            ) from None
        return [p.strip("\n") for p in text.split("\n\n") if p.strip()]
    if path.suffix in (".jsonl", ".json", ".txt") or os.sep in str(source):
        raise SparsityError(f"Calibration file {str(source)!r} does not exist.")
    return _read_dataset(str(source), text_column)


JSONL_FORMAT = 'JSON Lines: one object per line, like {"text": "..."}'


def _text(value, where: str, text_column: str) -> str:
    """A document's text; anything but a string (null, a number, a list) is refused, not stringified."""
    if not isinstance(value, str):
        raise SparsityError(
            f"{where}: {text_column!r} is {type(value).__name__} {value!r:.40}, not text. Give every row a "
            f"string in {text_column!r} (or drop the row)."
        )
    return value


def _read_jsonl(path: Path, text_column: str) -> list[str]:
    docs = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if not docs and line.lstrip().startswith("["):
                raise SparsityError(
                    f"{str(path)!r} is a JSON array; calibration data is {JSONL_FORMAT}. Write one object "
                    "per line (e.g. jq -c '.[]' FILE > FILE.jsonl)."
                )
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise SparsityError(
                    f"{str(path)!r} line {lineno} is not JSON ({e}); give {JSONL_FORMAT}."
                ) from None
            if not isinstance(row, dict):
                raise SparsityError(
                    f"{str(path)!r} line {lineno} is a JSON {type(row).__name__}, not an object; give "
                    f"{JSONL_FORMAT}."
                )
            if text_column not in row:
                raise SparsityError(
                    f"{str(path)!r} line {lineno} has no {text_column!r} field (it has {sorted(row)}); "
                    "name the text field with --text-column."
                )
            docs.append(_text(row[text_column], f"{str(path)!r} line {lineno}", text_column))
    if not docs:
        raise SparsityError(f"Calibration file {str(path)!r} holds no documents.")
    return docs


def _read_dataset(name: str, text_column: str) -> list[str]:
    try:
        from datasets import load_dataset

        ds = load_dataset(name, split="train")
    except Exception as e:  # ImportError, offline, unknown name: all mean "give a local file"
        raise SparsityError(
            f"Cannot load calibration dataset {name!r} ({type(e).__name__}: {e}). "
            "Pass a local .jsonl or .txt file with --calib-data."
        ) from None
    if text_column not in ds.column_names:
        raise SparsityError(
            f"Dataset {name!r} has no column {text_column!r} ({ds.column_names}); use --text-column."
        )
    return [_text(t, f"Dataset {name!r} row {i}", text_column) for i, t in enumerate(ds[text_column])]


def sample_calibration(
    docs: list[str], tokenizer, nsamples: int = 128, seqlen: int = 2048, seed: int = 0
) -> torch.Tensor:
    """``(nsamples, seqlen)`` token ids: random windows of random documents longer than ``seqlen``.

    Draws the same documents and offsets as the reference code for the same seed. A document
    is tokenized once (the reference re-tokenizes it when drawn again, with the same result).
    """
    if nsamples < 1:
        raise SparsityError(f"nsamples = {nsamples}: one-shot pruning needs at least 1 calibration sample.")
    if seqlen < 1:
        raise SparsityError(f"seqlen = {seqlen} must be at least 1.")
    if not docs:
        raise SparsityError("The calibration set holds no documents.")
    cache: dict[int, list[int]] = {}
    long_enough: set[int] = set()
    rng = random.Random(seed)
    samples = []
    for _ in range(nsamples):
        while True:
            i = rng.randint(0, len(docs) - 1)
            if i not in cache:
                cache[i] = tokenizer(docs[i])["input_ids"]
                if len(cache[i]) > seqlen:
                    long_enough.add(i)
            if i in long_enough:
                break
            if len(cache) == len(docs) and not long_enough:
                longest = max(len(t) for t in cache.values())
                raise SparsityError(
                    f"No calibration document is longer than seqlen={seqlen} tokens (the longest has "
                    f"{longest}). Lower --seqlen, or use a file with longer documents."
                )
        enc = cache[i]
        j = rng.randint(0, len(enc) - seqlen - 1)
        samples.append(enc[j : j + seqlen])
    return torch.tensor(samples, dtype=torch.long)
