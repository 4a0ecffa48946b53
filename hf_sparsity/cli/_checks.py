"""Up-front checks of command-line input, shared by the subcommands.

Each check raises :class:`hf_sparsity.utils.SparsityError` with one line that names the
problem and the fix; the CLI prints it as ``error: ...`` and exits 2. They run before
any model is loaded or any output is written, so a bad argument leaves nothing on disk.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..modeling import CONTEXT_KEYS
from ..utils import SparsityError

WIKITEXT2 = "wikitext2"  # eval's own suite: the Wanda/SparseGPT protocol (evaluation/wikitext2.py)

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def model_dir(path: str | None, flag: str = "MODEL", weights: bool = True) -> Path:
    """A folder written by ``save_pretrained``: it exists, holds ``config.json`` and (if ``weights``)
    weights."""
    if not path:
        raise SparsityError(f"Give {flag}: a model folder written by save_pretrained.")
    p = Path(path)
    if not p.exists():
        raise SparsityError(
            f"{flag} {path!r} does not exist. Give a model folder written by save_pretrained."
        )
    if not p.is_dir():
        raise SparsityError(f"{flag} {path!r} is a file, not a folder. Give the model folder that holds it.")
    if not (p / "config.json").is_file():
        raise SparsityError(
            f"{flag} {path!r} has no config.json: it is not a model folder. Give a folder written by "
            "save_pretrained (e.g. a checkpoint-N/ folder)."
        )
    if weights and not any((p / f).is_file() for f in WEIGHT_FILES):
        raise SparsityError(
            f"{flag} {path!r} has a config.json but no weights ({' / '.join(WEIGHT_FILES[:3])}). "
            "Save the model with model.save_pretrained(DIR) or point at the checkpoint folder that has them."
        )
    if weights and any((p / f).is_file() for f in WEIGHT_FILES[:2]):
        from ..checkpoint import check_weights_readable

        check_weights_readable(p)  # a truncated file: inspect's one-line error, not a loader traceback
    return p


def tokenizer_source(model: str, tokenizer: str | None = None) -> str:
    """The folder the tokenizer comes from: ``--tokenizer`` if given, else the model folder; it must hold
    one."""
    src = tokenizer or model
    flag = "--tokenizer" if tokenizer else "MODEL"
    p = Path(src)
    if tokenizer and not p.exists():
        raise SparsityError(
            f"--tokenizer {tokenizer!r} does not exist. Give a folder that holds tokenizer.json."
        )
    if p.is_dir() and not any((p / f).is_file() for f in TOKENIZER_FILES):
        fix = "pass --tokenizer DIR" if not tokenizer else "give a folder with tokenizer.json"
        raise SparsityError(
            f"No tokenizer in {flag} {src!r} (none of {', '.join(TOKENIZER_FILES)}): "
            f"save it with tokenizer.save_pretrained(DIR) or {fix}."
        )
    return src


def device(name: str | None) -> None:
    """``cpu``, ``cuda``, ``cuda:N``, ``mps``: the device must exist on this machine."""
    if name is None:
        return
    import torch

    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise SparsityError(f"--device {name!r} is not a device name. Use cpu, cuda or cuda:N.") from None
    if dev.type == "cpu":
        return
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise SparsityError(f"--device {name!r}: no CUDA GPU is available here. Use --device cpu.")
        if dev.index is not None and dev.index >= n:
            raise SparsityError(
                f"--device {name!r}: this machine has {n} CUDA device(s) (cuda:0..cuda:{n - 1})."
            )
        return
    if dev.type == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise SparsityError(f"--device {name!r}: MPS is not available here. Use --device cpu.")
        return
    raise SparsityError(f"--device {name!r} is not supported. Use cpu, cuda or cuda:N.")


def positive(value: int | float | None, flag: str) -> None:
    """``value`` is ``None`` (default) or above zero."""
    if value is not None and value <= 0:
        raise SparsityError(f"{flag} must be a positive number, got {value}.")


def existing_files(paths: str | list[str] | None, flag: str) -> None:
    """Every named file / folder / glob matches something."""
    import glob

    for p in [paths] if isinstance(paths, str) else paths or []:
        if not (os.path.exists(p) or glob.glob(p)):
            raise SparsityError(
                f"{flag} {p!r} does not exist. Check the path (data files are not downloaded)."
            )


def eval_limit(spec: str | None) -> None:
    """``--limit``: a positive number, or positive per-suite numbers."""
    if spec is None:
        return
    from ..evaluation.runner import parse_limit

    for suite, n in parse_limit(spec).items():
        if n is not None and n <= 0:
            where = "" if suite == "default" else f" for {suite}"
            raise SparsityError(
                f"--limit {spec!r} asks for {n} examples{where}: use a positive number, or leave --limit out "
                "to score everything."
            )


def eval_suites(spec: str, data_dir: str | None = None) -> None:
    """Every name in ``--suite`` is a named suite, a harness7 task, or a task the data folder (or lm-eval)
    has."""
    from ..evaluation.harness import HARNESS7, resolve_tasks_dir
    from ..evaluation.runner import SUITES, parse_suites

    known = set(SUITES) | set(HARNESS7) | {WIKITEXT2}
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
    from ..evaluation.harness import find_stock_yaml

    for s in unknown:
        try:
            find_stock_yaml(s)
        except SparsityError:
            raise SparsityError(
                f"Unknown suite or task {s!r}. Suites: {', '.join(SUITES)}; harness7 tasks: "
                f"{', '.join(HARNESS7)}; other lm-eval task names are listed by `lm_eval ls tasks`."
            ) from None


def model_config(path: str, flag: str = "--config") -> None:
    """A config.json path or a model folder whose config.json transformers can read."""
    p = Path(path)
    cfg = p if p.suffix == ".json" else p / "config.json"
    if not cfg.is_file():
        raise SparsityError(
            f"{flag} {path!r}: no config.json there. Give a config.json path or a model folder."
        )
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(str(cfg.parent) if p.suffix != ".json" else str(p))
    except Exception as e:  # unknown model_type, broken JSON, ...
        text = str(e).strip()
        first = text.splitlines()[0].split(". ")[0] if text else type(e).__name__
        raise SparsityError(f"{flag} {path!r}: transformers cannot read this config ({first}).") from None


def _backend(name: str) -> None:
    from ..backends import get_backend

    get_backend(name)  # SparsityError naming the registered backends


def _context_fits(model: str, context: int | None, flag: str = "--context") -> None:
    """``--context`` no longer than the positions the model has (else an index error deep in the model)."""
    if not context:
        return
    import json

    cfg = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
    for key in CONTEXT_KEYS:  # the keys and order modeling.context_length reads
        limit = cfg.get(key)
        if isinstance(limit, int) and limit > 0:
            if context > limit:
                raise SparsityError(
                    f"{flag} {context} is longer than the model's {key}={limit}; use at most {limit}."
                )
            return


def _offline_tasks(spec: str, data_dir: str | None) -> None:
    """lm-eval tasks without ``--data-dir`` download their data: say so up front when the Hub is off."""
    from ..evaluation.runner import harness_tasks, parse_suites

    offline = any(
        os.environ.get(v, "").lower() in ("1", "true", "yes")
        for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )
    tasks = harness_tasks([s for s in parse_suites(spec) if s != WIKITEXT2])
    if tasks and not data_dir and offline:
        raise SparsityError(
            f"{', '.join(tasks)} would download their data, but HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set: "
            "pass --data-dir DIR with local task data (laid out like shared/data/tasks)."
        )


# ------------------------------------------------------------------ one call per subcommand
def eval_args(args) -> None:
    """``hf_sparsity eval MODEL ...``."""
    model_dir(args.model)
    tokenizer_source(args.model, args.tokenizer)
    if args.data_dir and not os.path.isdir(args.data_dir):
        raise SparsityError(
            f"--data-dir {args.data_dir!r} does not exist. Give a folder laid out like shared/data."
        )
    eval_suites(args.suite, args.data_dir)
    eval_limit(args.limit)
    device(args.device)
    existing_files(args.pile_data, "--pile-data")
    existing_files(args.wikitext, "--wikitext")
    for flag, value in (
        ("--batch-size", args.batch_size),
        ("--context", args.context),
        ("--stride", args.stride),
        ("--seqlen", getattr(args, "seqlen", None)),
        ("--max-windows", getattr(args, "max_windows", None)),
    ):
        positive(value, flag)
    _context_fits(args.model, args.context)
    _offline_tasks(args.suite, args.data_dir)
    if args.dtype is not None:
        from ..evaluation.models import resolve_dtype

        resolve_dtype(args.dtype)


def bench_args(args) -> None:
    """``hf_sparsity bench ...``."""
    _backend(args.backend)
    device(args.device)
    if args.model:
        model_dir(args.model, "--model")
    if args.masks and args.masks != "zeros" and not os.path.exists(args.masks):
        raise SparsityError(f"--masks {args.masks!r} does not exist. Give a mask file or folder, or 'zeros'.")
    for flag in ("batch", "repeats", "rounds", "new_tokens", "prompt_len", "threads"):
        positive(getattr(args, flag, None), "--" + flag.replace("_", "-"))


def _has_tokenizer(model: str, flag: str) -> None:
    """A tokenizer saved in the model folder (for subcommands without ``--tokenizer``)."""
    if not any((Path(model) / f).is_file() for f in TOKENIZER_FILES):
        raise SparsityError(
            f"No tokenizer in {flag} {model!r} (none of {', '.join(TOKENIZER_FILES)}): save it there with "
            "tokenizer.save_pretrained(DIR)."
        )


def prune_args(args) -> None:
    """``hf_sparsity prune MODEL_DIR OUT_DIR ...``."""
    model_dir(args.model_dir, "MODEL_DIR")
    device(args.device)
    for flag in ("batch_size", "blocksize"):  # --nsamples / --seqlen: checked by prune_folder
        positive(getattr(args, flag, None), "--" + flag.replace("_", "-"))
    for flag in ("percdamp", "owl_lambda"):
        value = getattr(args, flag, None)
        if value is not None and value < 0:
            raise SparsityError(f"--{flag.replace('_', '-')} must not be negative, got {value}.")
    calib = args.calib_data
    if (
        calib
        and not Path(calib).is_file()
        and (Path(calib).suffix in (".jsonl", ".json", ".txt") or os.sep in calib)
    ):
        raise SparsityError(
            f"--calib-data {calib!r} does not exist. Give a .jsonl (one document per row) or .txt file."
        )
    if args.method != "magnitude":  # calibration: tokenize text, run windows through the model
        _has_tokenizer(args.model_dir, "MODEL_DIR")
        _context_fits(args.model_dir, args.seqlen, "--seqlen")


def generate_args(args) -> None:
    """``hf_sparsity generate MODEL_DIR ...``."""
    model_dir(args.model_dir, "MODEL_DIR")
    _has_tokenizer(args.model_dir, "MODEL_DIR")
    _backend(args.backend)
    if args.max_new_tokens < 1:
        raise SparsityError("--max-new-tokens must be at least 1.")
    positive(args.threads, "--threads")
    if args.masks and args.masks != "zeros" and not os.path.exists(args.masks):
        raise SparsityError(f"--masks {args.masks!r} does not exist. Give a mask file or folder, or 'zeros'.")


def generate_fits(model_dir: str, ids, max_new_tokens: int) -> None:
    """The prompt's tokens exist in the model's vocabulary, and prompt + new tokens fit its context
    (else an index error deep in the model)."""
    from transformers import AutoConfig

    from ..modeling import check_token_ids, context_length

    config = AutoConfig.from_pretrained(model_dir)
    check_token_ids(config, ids, model_dir)
    limit = context_length(config, default=0)
    n = ids.shape[1]
    # the last new token is never fed back, so n + max_new_tokens - 1 positions are used
    if limit and n + max_new_tokens - 1 > limit:
        fix = f"use --max-new-tokens {limit - n + 1} or less" if n <= limit else "shorten the prompt"
        raise SparsityError(
            f"The prompt's {n} tokens + --max-new-tokens {max_new_tokens} exceed the model's context of "
            f"{limit} tokens: {fix}."
        )
