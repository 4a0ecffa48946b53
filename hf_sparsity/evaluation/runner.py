"""``evaluate``: run named suites on a model folder or an in-memory model and collect one results dict."""

from __future__ import annotations

import datetime as _dt
import logging
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from ..checks import check_paths_exist, check_positive
from ..loading import (
    check_context_fits,
    check_device,
    check_model_folder,
    check_tokenizer_source,
    resolve_dtype,
)
from ..utils import SparsityError, library_version
from .harness import HARNESS7, find_stock_yaml, harness_averages, resolve_tasks_dir, run_harness
from .models import load_model_for_eval, sparsity_summary
from .perplexity import pile_loss, wikitext103_perplexity
from .wikitext2 import DEFAULT_WIKITEXT2, wikitext2_perplexity

logger = logging.getLogger(__name__)

SUITES = ("pile", "lambada", "wikitext103", "wikitext2", "harness7")
"""Named suites; any other name is taken as an lm-eval task name."""

DEFAULT_PILE = "corpus"  # under the data folder (--data-dir)
DEFAULT_WIKITEXT = "text/wikitext-103/wiki.test.tokens"


def parse_suites(spec: str | Sequence[str]) -> list[str]:
    """``"pile,harness7"`` or a list -> a de-duplicated list of suite / lm-eval task names."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out: list[str] = []
    for item in items:
        item = item.strip()
        if item and item not in out:
            out.append(item)
    if not out:
        raise SparsityError(f"No suite given. Choose from {', '.join(SUITES)} or lm-eval task names.")
    return out


def harness_tasks(suites: Sequence[str]) -> list[str]:
    """lm-eval task names the suites need (``lambada`` -> ``lambada_openai``), in order, once each."""
    tasks: list[str] = []
    for s in suites:
        names = HARNESS7 if s == "harness7" else ("lambada_openai",) if s == "lambada" else ()
        if s not in SUITES:
            names = (s,)
        tasks.extend(n for n in names if n not in tasks)
    return tasks


def parse_limit(spec: int | str | dict | None) -> dict[str, int | None]:
    """``50`` (every suite) or ``"harness7=50,pile=100,wikitext103=10"`` -> ``{suite: limit}``.

    A per-suite form's ``default`` key (or a bare number in the list) applies to suites not
    named. lm-eval tasks share one limit: ``harness7``'s, else ``lambada``'s, else the default.
    """
    if spec is None:
        return {}
    if isinstance(spec, dict):
        return {str(k): (None if v is None else int(v)) for k, v in spec.items()}
    if isinstance(spec, int):
        return {"default": spec}
    out: dict[str, int | None] = {}
    for part in str(spec).split(","):
        part = part.strip()
        if not part:
            continue
        key, _, value = part.rpartition("=")
        try:
            out[key.strip() or "default"] = int(value)
        except ValueError:
            raise SparsityError(
                f"Bad --limit {spec!r}: use a number, or suite=N pairs like "
                "harness7=100,pile=50,wikitext103=10."
            ) from None
    return out


def check_inputs(
    model: str | os.PathLike | None,
    suites: str | Sequence[str],
    *,
    tokenizer: Any = None,
    data_dir: str | os.PathLike | None = None,
    pile_data: Any = None,
    wikitext_file: Any = None,
    limit: int | str | dict | None = None,
    batch_size: int | None = None,
    context: int | None = None,
    stride: int | None = None,
    seqlen: int | None = None,
    max_windows: int | None = None,
    device: str | None = None,
    dtype: str | None = None,
) -> None:
    """Every input of :func:`evaluate`, checked before anything loads; a one-line :class:`SparsityError`.

    ``model`` is a folder (checked with its tokenizer, context and the suite names) or ``None``
    for an in-memory model (values and paths only: nothing loads, and ``EvalCallback`` calls
    this at every evaluation).
    """
    if model is not None:
        check_model_folder(model)
        if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
            check_tokenizer_source(str(model), None if tokenizer is None else str(tokenizer))
    if data_dir and not os.path.isdir(data_dir):
        raise SparsityError(
            f"--data-dir {str(data_dir)!r} does not exist. Give a folder with tasks/, corpus/ or text/."
        )
    spec = suites if isinstance(suites, str) else ",".join(suites)
    if model is not None:
        check_suites(spec, data_dir)
    if not isinstance(limit, dict):
        _check_limit(None if limit is None else str(limit))
    check_device(device)
    check_paths_exist(pile_data, "--pile-data")
    check_paths_exist(wikitext_file, "--wikitext")
    for flag, value in (
        ("--batch-size", batch_size),
        ("--context", context),
        ("--stride", stride),
        ("--seqlen", seqlen),
        ("--max-windows", max_windows),
    ):
        check_positive(value, flag)
    if model is not None:
        check_context_fits(str(model), context)
    resolve_dtype(dtype)


def _check_limit(spec: str | None) -> None:
    """``--limit``: a positive number, or positive per-suite numbers."""
    if spec is None:
        return
    for suite, n in parse_limit(spec).items():
        if n is not None and n <= 0:
            where = "" if suite == "default" else f" for {suite}"
            raise SparsityError(
                f"--limit {spec!r} asks for {n} examples{where}: use a positive number, or leave --limit out "
                "to score everything."
            )


def check_suites(spec: str, data_dir: str | None = None) -> None:
    """Every name in ``--suite`` is a named suite, a harness7 task, or a task the data folder (or lm-eval)
    has."""
    known = set(SUITES) | set(HARNESS7)
    unknown = [s for s in parse_suites(spec) if s not in known]
    if not unknown:
        return
    if data_dir:
        tasks_dir = resolve_tasks_dir(data_dir)
        local = sorted(d.name for d in tasks_dir.iterdir() if d.is_dir() and not d.name.startswith("."))
        missing = [s for s in unknown if s not in local]
        if missing:
            raise SparsityError(
                f"Unknown suite or task {', '.join(map(repr, missing))}. Suites: {', '.join(SUITES)}; "
                f"tasks in {str(tasks_dir)!r}: {', '.join(local) or 'none'}."
            )
        return

    for s in unknown:
        try:
            find_stock_yaml(s)
        except SparsityError:
            raise SparsityError(
                f"Unknown suite or task {s!r}. Suites: {', '.join(SUITES)}; harness7 tasks: "
                f"{', '.join(HARNESS7)}; other lm-eval task names are listed by `lm_eval ls tasks`."
            ) from None


def check_offline_tasks(spec: str, data_dir: str | None) -> None:
    """lm-eval tasks without ``--data-dir`` download their data: say so up front when the Hub is off.

    The command line's rule (``hf_sparsity eval`` calls it); from Python, lm-eval may still find
    the data in the ``datasets`` cache.
    """
    offline = any(
        os.environ.get(v, "").lower() in ("1", "true", "yes")
        for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )
    tasks = harness_tasks(parse_suites(spec))
    if tasks and not data_dir and offline:
        raise SparsityError(
            f"{', '.join(tasks)} would download their data, but HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set: "
            "pass --data-dir DIR with local task data (tasks/<task>/<split>.jsonl)."
        )


def _limit_for(limits: dict[str, int | None], *names: str) -> int | None:
    for n in names:
        if n in limits:
            return limits[n]
    return limits.get("default")


def _find_under(data_dir: str | os.PathLike | None, rel: str) -> Path | None:
    if data_dir is None:
        return None
    for base in (Path(data_dir), Path(data_dir).parent):
        if (base / rel).exists():
            return base / rel
    return None


def versions() -> dict[str, str | None]:
    """Versions of the libraries that determine the numbers."""
    import torch
    import transformers

    out = {
        "hf_sparsity": library_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    try:
        import lm_eval

        out["lm_eval"] = getattr(lm_eval, "__version__", None)
    except ImportError:
        out["lm_eval"] = None
    return out


def evaluate(
    model: str | os.PathLike | nn.Module,
    suites: str | Sequence[str] = "harness7",
    *,
    tokenizer: Any = None,
    data_dir: str | os.PathLike | None = None,
    pile_data: str | os.PathLike | Sequence[str] | None = None,
    wikitext_file: str | os.PathLike | None = None,
    wikitext2_file: str | os.PathLike | None = None,
    limit: int | str | dict | None = None,
    batch_size: int = 4,
    context: int | None = None,
    stride: int | None = None,
    seqlen: int | None = None,
    max_windows: int | None = None,
    device: str | None = None,
    dtype: str | None = None,
    tasks_out: str | os.PathLike | None = None,
    masks: dict | None = None,
    progress: bool = True,
    bootstrap_iters: int = 1000,
) -> dict[str, Any]:
    """Evaluate ``model`` on ``suites`` and return the results dict that :func:`write_report` saves.

    Args:
        model: a model folder (its ``sparsity_masks.safetensors`` is applied when present)
            or an in-memory causal LM (scored as is; pass ``tokenizer``).
        suites: ``pile``, ``lambada``, ``wikitext103``, ``wikitext2``, ``harness7``, or lm-eval task names.
        data_dir: a local data folder (``tasks/``, ``corpus/``,
            ``text/wikitext-103/``) or a tasks folder alone; makes lm-eval tasks offline.
        pile_data: Pile-format jsonl(.zst) file(s)/folder/glob; default ``DATA_DIR/corpus``.
        wikitext_file: ``wiki.test.tokens``; default under ``DATA_DIR``.
        wikitext2_file: ``wiki.test.raw`` for ``wikitext2``; default ``DATA_DIR/text/wikitext-2-raw``.
        limit: lm-eval examples per task, Pile documents, WikiText articles: one number
            for all, or per suite (``"harness7=100,pile=50,wikitext103=10"``, see :func:`parse_limit`).
        context: window for Pile loss and WikiText (default: the model's context).
        stride: WikiText tokens scored per window (Megatron's overlapping eval).
        seqlen, max_windows: ``wikitext2`` (the Wanda / SparseGPT protocol, one window per
            forward): the window length (default: the model's context) and the windows scored.
        masks: for an in-memory model, the masks it runs under (only for the report).
    """
    # Long by design: one short branch per suite, in the order the results are reported.
    check_inputs(
        model if isinstance(model, (str, os.PathLike)) else None, suites, tokenizer=tokenizer,
        data_dir=data_dir, pile_data=pile_data, wikitext_file=wikitext_file, limit=limit,
        batch_size=batch_size, context=context, stride=stride, seqlen=seqlen, max_windows=max_windows,
        device=device, dtype=dtype,
    )  # fmt: skip
    suites = parse_suites(suites)
    limits = parse_limit(limit)
    t_start = time.time()
    if isinstance(model, (str, os.PathLike)):
        model_name = str(model)
        t0 = time.time()
        model, tok, masks = load_model_for_eval(model, device=device, dtype=dtype, tokenizer=tokenizer)
        load_s = time.time() - t0
    else:
        model_name = getattr(getattr(model, "config", None), "name_or_path", None) or type(model).__name__
        tok = tokenizer
        load_s = 0.0
        if tok is None:
            raise SparsityError(
                "Evaluating an in-memory model needs its tokenizer: evaluate(model, ..., tokenizer=tok)."
            )
    results: dict[str, Any] = {
        "model": model_name,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "suites": suites,
        "metrics": {},
        "settings": {
            "limit": limits or None,
            "batch_size": batch_size,
            "context": context,
            "stride": stride,
            "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
            "device": str(next(model.parameters()).device),
        },
        "data": {"data_dir": str(Path(data_dir).resolve()) if data_dir else None},
        "wall_time_s": {"load": round(load_s, 2)},
        "sparsity": sparsity_summary(model, masks, seq_len=context),
        "versions": versions(),
    }
    metrics = results["metrics"]

    if "pile" in suites:
        data = pile_data or _find_under(data_dir, DEFAULT_PILE)
        if data is None:
            raise SparsityError(
                "The pile suite needs a Pile-format corpus: pass --pile-data FILE or --data-dir DIR."
            )
        t0 = time.time()
        metrics["pile"] = pile_loss(
            model,
            tok,
            data,
            context=context,
            batch_size=batch_size,
            limit=_limit_for(limits, "pile"),
            progress=progress,
        )
        results["wall_time_s"]["pile"] = round(time.time() - t0, 2)
        results["data"]["pile"] = [str(p) for p in _as_list(data)]

    if "wikitext103" in suites:
        path = wikitext_file or _find_under(data_dir, DEFAULT_WIKITEXT)
        text = None
        if path is None:
            text = _download_wikitext103()
        t0 = time.time()
        metrics["wikitext103"] = wikitext103_perplexity(
            model, tok, path, text=text, context=context, stride=stride, batch_size=batch_size,
            limit=_limit_for(limits, "wikitext103"), progress=progress,
        )  # fmt: skip
        results["wall_time_s"]["wikitext103"] = round(time.time() - t0, 2)
        results["data"]["wikitext103"] = str(path) if path else "hf:Salesforce/wikitext wikitext-103-v1 test"

    if "wikitext2" in suites:
        path = wikitext2_file or (Path(data_dir) / DEFAULT_WIKITEXT2 if data_dir else None)
        if path is None:
            raise SparsityError(f"The wikitext2 suite needs --data-dir DIR holding {DEFAULT_WIKITEXT2}.")
        t0 = time.time()
        metrics["wikitext2"] = wikitext2_perplexity(
            model, tok, path, seqlen=seqlen, max_windows=max_windows, batch_size=1, progress=progress
        )
        results["wall_time_s"]["wikitext2"] = round(time.time() - t0, 2)
        results["data"]["wikitext2"] = str(path)

    tasks = harness_tasks(suites)
    if tasks:
        t0 = time.time()
        out = run_harness(
            model, tok, tasks, data_dir=data_dir, tasks_out=tasks_out,
            limit=_limit_for(limits, "harness7", "lambada", *tasks), batch_size=batch_size,
            bootstrap_iters=bootstrap_iters,
        )  # fmt: skip
        results["wall_time_s"]["harness"] = round(time.time() - t0, 2)
        results["data"]["tasks"] = (
            "offline: " + (out["tasks_dir"] or "generated") if data_dir else "lm-eval stock"
        )
        metrics["harness"] = out["tasks"]
        if "lambada" in suites and "lambada_openai" in out["tasks"]:
            lam = out["tasks"]["lambada_openai"]
            metrics["lambada"] = {k: lam.get(k) for k in ("acc", "acc_stderr", "perplexity", "samples")}
        if "harness7" in suites:
            metrics["harness7"] = harness_averages(out["tasks"])
    results["wall_time_s"]["total"] = round(time.time() - t_start, 2)
    return results


def evaluate_wikitext2(
    model_dir: str | os.PathLike,
    data_dir: str | os.PathLike | None = None,
    wikitext2_file: str | os.PathLike | None = None,
    seqlen: int | None = None,
    max_windows: int | None = None,
    batch_size: int = 1,
    device: str | None = None,
    dtype: str | None = None,
    tokenizer: Any = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Load a model folder (masks applied) and score it with :func:`wikitext2_perplexity`.

    The same as ``evaluate(model_dir, "wikitext2", ...)["metrics"]["wikitext2"]`` plus the
    ``model`` and ``data`` it was computed on.
    """
    if batch_size != 1:
        raise SparsityError("The wikitext2 protocol scores one window per forward; leave batch_size at 1.")
    res = evaluate(
        model_dir, ["wikitext2"], tokenizer=tokenizer, data_dir=data_dir, wikitext2_file=wikitext2_file,
        seqlen=seqlen, max_windows=max_windows, device=device, dtype=dtype, progress=progress,
    )  # fmt: skip
    return wikitext2_result(res)


def wikitext2_result(results: dict[str, Any]) -> dict[str, Any]:
    """The ``wikitext2`` figures of an ``evaluate`` result, with the model and data they were computed on."""
    return dict(results["metrics"]["wikitext2"], model=results["model"], data=results["data"]["wikitext2"])


def _as_list(x):
    return [x] if isinstance(x, (str, os.PathLike)) else list(x)


def _download_wikitext103() -> str:
    """Online fallback: WikiText-103 test from the Hub, joined back into the word-level file's text."""
    try:
        from datasets import load_dataset

        ds = load_dataset("Salesforce/wikitext", "wikitext-103-v1", split="test")
    except Exception as e:
        raise SparsityError(
            f"No local WikiText-103 file and the Hub copy could not be loaded ({type(e).__name__}). "
            "Pass --wikitext FILE (wiki.test.tokens) or --data-dir DIR."
        ) from None
    return "".join(ds["text"])
