"""Up-front checks of command-line input, shared by the subcommands.

The checks of a model folder, a device, a tokenizer and plain values live in the library
(:mod:`hf_sparsity.loading`, :mod:`hf_sparsity.checks`) and are imported here; ``eval``'s are
made by :func:`hf_sparsity.evaluation.evaluate` itself (:func:`hf_sparsity.evaluation.runner.check_inputs`).

Each check raises :class:`hf_sparsity.utils.SparsityError` with one line that names the
problem and the fix; the CLI prints it as ``error: ...`` and exits 2. They run before
any model is loaded or any output is written, so a bad argument leaves nothing on disk.
"""

# Lazy imports: a subcommand imports the library when it runs, so `--help` and the others start fast.

from __future__ import annotations

import os
from pathlib import Path

from ..checks import check_positive as positive
from ..loading import TOKENIZER_FILES
from ..loading import check_device as device
from ..loading import check_model_folder as model_dir
from ..utils import SparsityError


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


# ------------------------------------------------------------------ one call per subcommand
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


def generate_args(args) -> None:
    """``hf_sparsity generate MODEL_DIR ...``."""
    if getattr(args, "head", None) and not getattr(args, "values", None):
        raise SparsityError(
            f"--head {args.head} goes with --values int8 (the float model's head is left as it is); add "
            "--values int8, or drop --head."
        )
    model_dir(args.model_dir, "MODEL_DIR")
    _has_tokenizer(args.model_dir, "MODEL_DIR")
    _backend(args.backend)
    if args.max_new_tokens < 1:
        raise SparsityError("--max-new-tokens must be at least 1.")
    positive(args.threads, "--threads")
    if args.masks and args.masks != "zeros" and not os.path.exists(args.masks):
        raise SparsityError(f"--masks {args.masks!r} does not exist. Give a mask file or folder, or 'zeros'.")
    if getattr(args, "lean", False) and getattr(args, "compile", False):
        raise SparsityError("--lean and --compile are two decoding loops; pick one.")
    if getattr(args, "values", None):
        _int8_values(args.backend, args.model_dir)
    _sampling(args)
    if getattr(args, "activations", None):
        if not getattr(args, "values", None):
            raise SparsityError(
                "--activations goes with --values int8 (int8 weight values); add that, or drop it."
            )
        if args.activations == "float32" and args.backend == "auto":
            raise SparsityError(
                "--activations float32: auto measures the int8 products; pick --backend bitmask, nm24 or "
                "native_dense for float32 activations."
            )


def _sampling(args) -> None:
    """``--do-sample`` and its options: each within its range, and none without ``--do-sample``."""
    ranges = {  # option: (valid, the range said)
        "temperature": (lambda v: v > 0, "above 0"),
        "top_k": (lambda v: v >= 0, "0 (none) or more"),
        "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
        "min_p": (lambda v: 0 <= v <= 1, "in [0, 1]"),
        "repetition_penalty": (lambda v: v > 0, "above 0 (1: none)"),
    }
    for name, (valid, said) in ranges.items():
        value = getattr(args, name, None)
        flag = "--" + name.replace("_", "-")
        if value is None:
            continue
        if not valid(value):
            raise SparsityError(f"{flag} {value}: it must be {said}.")
        if name != "repetition_penalty" and not getattr(args, "do_sample", False):
            raise SparsityError(f"{flag} shapes sampling: add --do-sample, or drop {flag} (greedy decoding).")


def _int8_values(backend: str, folder: str) -> None:
    """``--values int8``: a backend that stores int8 values, and a folder whose weights are not quantized."""
    import json

    from ..backends import available_backends, get_backend

    if not get_backend(backend, check_available=False).capabilities.int8_values:
        have = " / ".join(n for n in available_backends() if get_backend(n).capabilities.int8_values)
        raise SparsityError(f"--values int8: backend {backend!r} has no int8 values; use --backend {have}.")
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            quant = json.load(f).get("quantization_config")
    except (OSError, ValueError):
        quant = None
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise SparsityError(
            f"--values int8: {folder} is already quantized ({method}); int8 values need float weights. "
            "Use the unquantized checkpoint, or drop --values."
        )


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
