"""``prune_folder``: model folder in, sparse model folder out (what ``hf_sparsity prune`` runs).

Every argument is checked here, once, before the model is loaded (the CLI only parses), and
the output folder is built under a temporary name and renamed into place, so a bad input never
leaves a partial OUT.
"""

from __future__ import annotations

import logging
import os
from functools import partial
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ..constants import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME
from ..loading import TOKENIZER_FILES, check_context_fits, check_device, check_model_folder
from ..mask_engine.config import SparsityConfig, check_level, check_structure
from ..mask_engine.targeting import plan_sparsity
from ..modeling import check_token_ids
from ..storage.masks_file import load_masks
from ..utils import SparsityError, atomic_dir, check_out_dir
from .algorithms import get_method, needs_calibration
from .calibration import read_documents, sample_calibration
from .levels import OWLSettings
from .oneshot import OneShotResult, check_speed_args, prune_oneshot
from .reconstruct import DEFAULT_LR, check_steps
from .save import write_sparsity_files, write_spdy_card
from .spdy import DEFAULT_LEVELS, SpeedTarget, TimeTable, parse_levels, reachable, shape_key
from .spdy_search import DEFAULT_SEARCH_MOVES, DEFAULT_SEARCH_STEPS, DEFAULT_SEARCH_WINDOWS
from .speed import measure_decode_ms, step_time_table
from .streaming import StreamingModel

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


def _check_inputs(
    model_dir,
    out_dir,
    method,
    nsamples,
    seqlen,
    calib_data,
    overwrite,
    *,
    device=None,
    batch_size=8,
    blocksize=128,
    percdamp=0.01,
    owl_lambda=None,
    refit=False,
    reconstruct_steps=None,
    masks=None,
    speed=None,
) -> bool:
    """Every argument of :func:`prune_folder`, checked once, before anything loads or is written.

    Returns whether the run needs calibration data.
    """
    check_model_folder(model_dir, "MODEL_DIR")
    get_method(method)  # an unknown name: a one-line error listing the known ones
    check_device(device)
    for flag, value in (("--batch-size", batch_size), ("--blocksize", blocksize)):
        if value is not None and value <= 0:
            raise SparsityError(f"{flag} must be a positive number, got {value}.")
    for flag, value in (("--percdamp", percdamp), ("--owl-lambda", owl_lambda)):
        if value is not None and value < 0:
            raise SparsityError(f"{flag} must not be negative, got {value}.")
    check_steps(reconstruct_steps)
    if speed is not None:
        check_speed_args(method, owl_lambda, masks, [])
    if masks is not None and not Path(masks).exists():
        raise SparsityError(
            f"--masks {str(masks)!r} does not exist. Give a mask file or the folder holding one."
        )
    calib = str(calib_data) if calib_data else None
    if (
        calib
        and not Path(calib).is_file()
        and (Path(calib).suffix in (".jsonl", ".json", ".txt") or os.sep in calib)
    ):
        raise SparsityError(
            f"--calib-data {calib!r} does not exist. Give a .jsonl (one document per row) or .txt file."
        )
    calibrated = needs_calibration(method, refit, reconstruct_steps, masks)
    what = method if masks is None and get_method(method).calibrated else "--refit / --reconstruct"
    if calibrated:
        if nsamples < 1:
            raise SparsityError(f"--nsamples {nsamples}: {what} needs at least 1 calibration sample.")
        if seqlen < 2:
            raise SparsityError(f"--seqlen {seqlen}: use at least 2 tokens per calibration window.")
        if not calib_data:
            raise SparsityError(f"{what} needs calibration text: pass --calib-data FILE.jsonl|FILE.txt.")
        if not any((Path(model_dir) / f).is_file() for f in TOKENIZER_FILES):
            raise SparsityError(
                f"No tokenizer in MODEL_DIR {str(model_dir)!r} (none of {', '.join(TOKENIZER_FILES)}): "
                "save it there with tokenizer.save_pretrained(DIR)."
            )
        check_context_fits(str(model_dir), seqlen, "--seqlen")
    check_out_dir(model_dir, out_dir, overwrite)
    return calibrated


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
    refit: bool = False,
    reconstruct_steps: int | None = None,
    reconstruct_lr: float = DEFAULT_LR,
    masks: str | os.PathLike | None = None,
    streaming: bool = True,
    target_speedup: float | None = None,
    values: str | None = None,
    spdy_levels=None,
    threads: int | None = None,
    measure_rounds: int = 5,
    spdy_errors: dict[str, list[float]] | None = None,
    spdy_table: TimeTable | None = None,
    spdy_search_steps: int = DEFAULT_SEARCH_STEPS,
    spdy_search_windows: int = DEFAULT_SEARCH_WINDOWS,
    spdy_database: dict | None = None,
    spdy_search_moves: int = DEFAULT_SEARCH_MOVES,
) -> OneShotResult:
    """Prune ``model_dir`` one-shot and write a sparse model folder to ``out_dir``; every input is checked
    here, before anything loads or is written (the CLI only parses). ``reconstruct_steps``: block
    reconstruction steps (``None``: off). ``masks``: a mask file (or a folder holding it) to use instead of
    choosing masks. ``streaming``: read and write a safetensors folder one decoder block at a time
    (:mod:`~hf_sparsity.pruning.streaming`); ``.bin`` weights, and ``streaming=False``, load the whole model.
    ``target_speedup``: levels from the grid ``spdy_levels`` for this decoding speed-up over the dense model
    with the same ``values`` with ``threads`` (:mod:`~.spdy`); the speed-up measured over ``measure_rounds``
    rounds (0: not) goes in the folder's ``README.md`` with the levels; ``spdy_errors``, ``spdy_database``
    (a dict, filled when empty), ``spdy_table``: a plan's error table, search database and time table to
    reuse (same model, calibration, grid; values and threads for the table); ``spdy_search_*``: the search."""
    search = (spdy_search_steps, spdy_search_windows, spdy_database, spdy_search_moves)
    speed = _speed_target(target_speedup, values, spdy_levels, threads, sparsity, structure, measure_rounds,
                          spdy_errors, spdy_table, search)  # fmt: skip
    calibrated = _check_inputs(
        model_dir, out_dir, method, nsamples, seqlen, calib_data, overwrite, device=device,
        batch_size=batch_size, blocksize=blocksize, percdamp=percdamp, owl_lambda=owl_lambda, refit=refit,
        reconstruct_steps=reconstruct_steps, masks=masks, speed=speed,
    )  # fmt: skip
    config = build_config(sparsity, structure, config_path)
    owl = OWLSettings(lam=owl_lambda) if owl_lambda is not None else None
    given = load_masks(masks)[0] if masks is not None else None
    has_tokenizer = any((Path(model_dir) / f).is_file() for f in TOKENIZER_FILES)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir)) if has_tokenizer else None
    model_config = AutoConfig.from_pretrained(str(model_dir))
    calib, info = None, {}
    if calibrated:  # calibration first: bad data is refused before the model loads
        docs = read_documents(calib_data, text_column)
        calib = sample_calibration(docs, tokenizer, nsamples=nsamples, seqlen=seqlen, seed=seed)
        check_token_ids(model_config, calib, model_dir)
        info = {"calib_data": str(calib_data), "text_column": text_column, "seed": seed}
        if given is None:
            info.update(get_method(method).settings(blocksize, percdamp))
    if speed is not None:  # measured, and an unreachable target refused, before anything is written
        speed.table = _time_table(model_dir, config, speed, progress, speed.table)
    info.update({"owl": {"lambda": owl.lam, "M": owl.outlier_m}} if owl is not None else {})
    info.update({"masks": str(masks)} if masks is not None else {})
    kwargs = dict(
        blocksize=blocksize, percdamp=percdamp, owl=owl, device=device, batch_size=batch_size,
        progress=progress, refit=refit, reconstruct_steps=reconstruct_steps or 0,
        reconstruct_lr=reconstruct_lr, masks=given, speed=speed,
    )  # fmt: skip
    finish = partial(_measure_and_card, model_dir, speed=speed, rounds=measure_rounds) if speed else None
    return _prune_and_write(model_dir, out_dir, config, calib, method, model_config, tokenizer, info, kwargs,
                            overwrite=overwrite, streaming=streaming, finish=finish)  # fmt: skip


def _speed_target(
    target_speedup, values, levels, threads, sparsity, structure, measure_rounds, errors=None, table=None,
    search=(DEFAULT_SEARCH_STEPS, DEFAULT_SEARCH_WINDOWS, None, DEFAULT_SEARCH_MOVES),
):  # fmt: skip
    """The :class:`SpeedTarget` of ``--target-speedup`` (checked), or ``None``; ``--values`` alone refused."""
    if target_speedup is None:
        if values not in (None, "float32") or levels is not None:
            raise SparsityError("--values / --spdy-levels go with --target-speedup S; add it or drop them.")
        return None
    if sparsity is not None or structure is not None:
        raise SparsityError(
            "--target-speedup chooses each layer's level; drop --sparsity / --structure (or the target)."
        )
    if measure_rounds < 0:
        raise SparsityError(f"measure_rounds {measure_rounds}: use 0 (do not measure) or more.")
    if isinstance(levels, str):
        levels = parse_levels(levels)
    levels = levels if levels is not None else DEFAULT_LEVELS
    return SpeedTarget(target_speedup, levels, values, threads, errors=errors, table=table,
                       search_steps=search[0], search_windows=search[1], database=search[2],
                       search_moves=search[3])  # fmt: skip


def folder_time_table(
    model_dir, values: str | None = None, levels=DEFAULT_LEVELS, threads: int | None = None, config=None,
    progress: bool = False,
) -> tuple[TimeTable, list[str]]:  # fmt: skip
    """The speed target's time table for the targets of ``model_dir`` (``config``: default targets),
    measured on the dense model's own decoding step (:func:`~.speed.step_time_table`), and the targets'
    shapes in order."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    targets = [d for d in plan_sparsity(model, config or SparsityConfig(sparsity=0.5)) if d.sparsify]
    table = step_time_table(model, targets, tuple(levels), values, threads, progress=progress)
    return table, [shape_key(d) for d in targets]


def _target_shapes(model_dir, config=None) -> list[str]:
    """The shapes of ``model_dir``'s targets (``config``: default targets), in order, from a meta model."""
    from accelerate import init_empty_weights

    model_config = AutoConfig.from_pretrained(str(model_dir))
    with init_empty_weights(include_buffers=False):
        meta = AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)
    return [shape_key(d) for d in plan_sparsity(meta, config or SparsityConfig(sparsity=0.5)) if d.sparsify]


def _time_table(model_dir, config, speed: SpeedTarget, progress: bool, given: TimeTable | None) -> TimeTable:
    """:func:`folder_time_table` for ``speed`` (``given``: measured already); an unreachable target refused
    before anything is written."""
    if given is not None:
        table, shapes = given, _target_shapes(model_dir, config)
        if tuple(table.levels) != tuple(speed.levels) or not set(shapes) <= set(table.ms):
            raise SparsityError(
                f"spdy_table: a table of levels {list(table.levels)} and shapes {sorted(table.ms)} does not "
                f"fit this model and --spdy-levels {list(speed.levels)}; measure it with folder_time_table."
            )
    else:
        table, shapes = folder_time_table(
            model_dir, speed.values, speed.levels, speed.threads, config, progress
        )
    reachable(speed.speedup, table.dense_total(shapes), table.fastest_total(shapes), table.levels)
    return table


def _measure_and_card(model_dir, folder, result: OneShotResult, *, speed: SpeedTarget, rounds: int) -> None:
    """Decode the dense and the pruned model (interleaved) and write the model card with the plan."""
    plan = result.spdy
    if plan is not None and rounds:
        both = {"dense": (model_dir, True), "pruned": (folder, False)}
        ms = measure_decode_ms(both, speed.values, speed.threads, rounds=rounds)
        plan.measured_ms = ms
        plan.measured_speedup = ms["dense"] / ms["pruned"]
    if plan is not None:
        write_spdy_card(folder, plan, result.method, rounds)


def _prune_and_write(model_dir, out_dir, config, calib, method, model_config, tokenizer, info, kwargs, *,
                     overwrite, streaming, finish=None) -> OneShotResult:  # fmt: skip
    """Prune and write ``out_dir``: block by block from a safetensors folder (``streaming``), else the
    whole model loaded."""
    if streaming and any(
        (Path(model_dir) / f).is_file() for f in (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME)
    ):
        stream = StreamingModel(model_dir, model_config)
        with atomic_dir(out_dir, overwrite=overwrite, source=model_dir) as tmp:
            stream.out = tmp
            result = prune_oneshot(stream.model, config, calib, method, stream=stream, **kwargs)
            stream.finish()
            write_sparsity_files(tmp, model_config, result, config, tokenizer, info)
            if finish is not None:
                finish(tmp, result)
        return result
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype="auto")
    model.eval()
    result = prune_oneshot(model, config, calib, method, **kwargs)
    with atomic_dir(out_dir, overwrite=overwrite, source=model_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        write_sparsity_files(tmp, model.config, result, config, tokenizer, info)
        if finish is not None:
            finish(tmp, result)
    return result
