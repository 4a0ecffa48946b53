"""Write a pruned model as a sparse model folder, atomically.

The folder is what training writes: weights with exact zeros at masked positions,
``sparsity_masks.safetensors``, the ``sparsity`` section in ``config.json`` (with the
one-shot method and calibration settings under ``_state.oneshot``) and the tokenizer.
Stock transformers loads it; :class:`~hf_sparsity.SparsityCallback` picks up its masks.
"""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path
from typing import Any

import torch

from ..constants import SPARSITY_MASKS_NAME
from ..mask_engine.config import SparsityConfig, set_sparsity_config
from ..storage.masks_file import save_masks
from ..utils import atomic_dir, atomic_write_text, library_version
from .oneshot import OneShotResult


def oneshot_state(result: OneShotResult, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON-simple record of a one-shot run, kept in config.json and in the mask file."""
    record = {"method": result.method, "seconds": round(result.seconds, 2), **result.info}
    record.update(extra or {})
    return {
        "optimizer_steps": 0,
        "events": [{"step": 0, "kind": "oneshot", "method": result.method}],
        "oneshot": record,
    }


def save_pruned(
    model,
    result: OneShotResult,
    out_dir: str | os.PathLike,
    config: SparsityConfig | None = None,
    tokenizer=None,
    info: dict[str, Any] | None = None,
    model_dir: str | os.PathLike | None = None,
    overwrite: bool = False,
) -> Path:
    """Save ``model`` (already pruned by :func:`prune_oneshot`) with ``result.masks`` to ``out_dir``."""
    with atomic_dir(out_dir, overwrite=overwrite, source=model_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        write_sparsity_files(tmp, model.config, result, config, tokenizer, info)
    return Path(out_dir)


def write_sparsity_files(
    folder: str | os.PathLike,
    model_config,
    result: OneShotResult,
    config: SparsityConfig | None = None,
    tokenizer=None,
    info: dict[str, Any] | None = None,
) -> None:
    """``config.json`` with the sparsity section, the mask file and the tokenizer, into ``folder``
    (weights are written by the caller: ``save_pretrained``, or shard by shard when streaming)."""
    if config is None:
        config = SparsityConfig(sparsity=_overall_level(result))
    state = oneshot_state(result, info)
    set_sparsity_config(model_config, config, state={"oneshot": state["oneshot"]})
    model_config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    save_masks(os.path.join(folder, SPARSITY_MASKS_NAME), result.masks, {"state": state})


def _overall_level(result: OneShotResult) -> float:
    total = sum(m.numel() for m in result.masks.values())
    zeros = sum(int((m == 0).sum()) for m in result.masks.values())
    return round(zeros / max(total, 1), 6)


def write_spdy_card(folder: str | os.PathLike, plan, method: str, rounds: int) -> Path:
    """``README.md`` of a folder pruned for a speed target: the target, the predicted and the measured
    decoding speed-up, the machine, and the level chosen for each layer (written atomically)."""
    vt = plan.table.values or "float32"
    threads = plan.table.threads or torch.get_num_threads()
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    measured = (
        f"{plan.measured_speedup:.3f}x (dense {plan.measured_ms['dense']:.3f} ms/token, pruned "
        f"{plan.measured_ms['pruned']:.3f} ms/token; greedy decoding, medians of {rounds} interleaved rounds)"
        if plan.measured_speedup
        else "not measured"
    )
    lines = [
        "---", "library_name: transformers", "tags:", "- sparse", "- sparsity", "- hf_sparsity", "---", "",
        "## Sparsity (hf_sparsity): levels chosen for a decoding speed target", "",
        f"Pruned with `{method}` at per-layer levels chosen by SPDY's dynamic program (Frantar & "
        f"Alistarh 2022) for a decoding speed-up of **{plan.speedup:g}x** over the dense model with {vt} "
        "values.", "",
        f"* predicted speed-up: {plan.predicted_speedup:.3f}x (step {plan.predicted_ms:.3f} ms of dense "
        f"{plan.dense_ms:.3f} ms; {plan.table.other_ms:.3f} ms outside the pruned layers)",
        f"* measured speed-up: {measured}",
        f"* measured on {cpu}, {threads} threads, {datetime.date.today().isoformat()}, "
        f"hf_sparsity {library_version()}, torch {torch.__version__}",
        f"* candidate levels: {', '.join(f'{x:g}' for x in plan.table.levels)}", "",
        "| layer | level | relative error at that level |", "|---|---|---|",
    ]  # fmt: skip
    for name, level in plan.levels.items():
        k = plan.table.levels.index(level)
        lines.append(f"| `{name}` | {level:.2f} | {plan.errors[name][k]:.4g} |")
    path = Path(folder) / "README.md"
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path
