"""``prune_folder``: model folder in, sparse model folder out (what ``hf_sparsity prune`` runs).

Every argument is checked before the model is loaded, and the output folder is built under a
temporary name and renamed into place, so a bad input never leaves a partial OUT.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ..config import SparsityConfig, check_level, check_structure
from ..modeling import check_token_ids, context_length
from ..utils import SparsityError, check_out_dir
from .calibration import read_documents, sample_calibration
from .levels import OWLSettings
from .methods import METHODS
from .oneshot import OneShotResult, prune_oneshot
from .save import save_pruned

logger = logging.getLogger(__name__)


def build_config(
    sparsity: float | None, structure: str | None, config_path: str | os.PathLike | None
) -> SparsityConfig:
    """The sparsity config from ``--config`` (a params YAML), ``--sparsity`` and ``--structure``."""
    if config_path is not None:
        if sparsity is not None or structure is not None:
            raise SparsityError("Give either --config or --sparsity/--structure, not both.")
        return SparsityConfig.from_yaml(config_path)
    if structure is not None:
        n, m = check_structure(structure)
        level = 1.0 - n / m
        if sparsity is not None and abs(sparsity - level) > 1e-9:
            raise SparsityError(
                f"--structure {structure} means sparsity {level}; drop --sparsity {sparsity}."
            )
        return SparsityConfig(sparsity=level, structure=structure)
    return SparsityConfig(sparsity=check_level(0.5 if sparsity is None else sparsity, "--sparsity"))


def _check_inputs(model_dir, out_dir, method, nsamples, seqlen, calib_data, overwrite) -> None:
    if method not in METHODS:
        raise SparsityError(f"Unknown method {method!r}; use one of {', '.join(METHODS)}.")
    if not Path(model_dir).is_dir():
        raise SparsityError(f"Model folder {str(model_dir)!r} does not exist.")
    check_out_dir(model_dir, out_dir, overwrite)
    if method != "magnitude":
        if nsamples < 1:
            raise SparsityError(f"--nsamples {nsamples}: {method} needs at least 1 calibration sample.")
        if seqlen < 2:
            raise SparsityError(f"--seqlen {seqlen}: use at least 2 tokens per calibration window.")
        if not calib_data:
            raise SparsityError(f"{method} needs calibration text: pass --calib-data FILE.jsonl|FILE.txt.")


def prune_folder(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    method: str = "wanda",
    sparsity: float | None = None,
    structure: str | None = None,
    config_path: str | os.PathLike | None = None,
    calib_data: str | None = None,
    text_column: str = "text",
    nsamples: int = 128,
    seqlen: int = 2048,
    seed: int = 0,
    device: str | None = None,
    batch_size: int = 8,
    blocksize: int = 128,
    percdamp: float = 0.01,
    owl_lambda: float | None = None,
    overwrite: bool = False,
    progress: bool = False,
) -> OneShotResult:
    """Load ``model_dir``, prune it one-shot and write a sparse model folder to ``out_dir``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    _check_inputs(model_dir, out_dir, method, nsamples, seqlen, calib_data, overwrite)
    config = build_config(sparsity, structure, config_path)
    owl = OWLSettings(lam=owl_lambda) if owl_lambda is not None else None
    if device and device.startswith("cuda") and not torch.cuda.is_available():
        raise SparsityError(f"--device {device} but no CUDA device is available; use --device cpu.")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    calib, info = None, {}
    if method != "magnitude":  # calibration first: bad data is refused before the model loads
        model_config = AutoConfig.from_pretrained(str(model_dir))
        ctx = context_length(model_config, default=0)
        if ctx and seqlen > ctx:
            raise SparsityError(f"--seqlen {seqlen} exceeds the model's context length {ctx}; lower it.")
        docs = read_documents(calib_data, text_column)
        calib = sample_calibration(docs, tokenizer, nsamples=nsamples, seqlen=seqlen, seed=seed)
        check_token_ids(model_config, calib, model_dir)
        info = {"calib_data": str(calib_data), "text_column": text_column, "seed": seed}
        if method == "sparsegpt":
            info.update(blocksize=blocksize, percdamp=percdamp)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype="auto")
    model.eval()
    if owl is not None:
        info["owl"] = {"lambda": owl.lam, "M": owl.outlier_m}
    result = prune_oneshot(
        model, config, calib, method, blocksize=blocksize, percdamp=percdamp, owl=owl,
        device=device, batch_size=batch_size, progress=progress,
    )  # fmt: skip
    save_pruned(model, result, out_dir, config=config, tokenizer=tokenizer, info=info,
                model_dir=model_dir, overwrite=overwrite)  # fmt: skip
    return result
