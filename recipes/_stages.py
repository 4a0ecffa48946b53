"""What the recipes' training stages share that is not the ``Trainer`` itself: skipping a stage a resumed
run already finished (:func:`stage_done`), recording a finished one (:func:`record_stage`,
``stage_done.json``), two callbacks a recipe may list (:class:`EvalAt`, :class:`StagePrinter`), and
finalize / reload between stages. Each recipe builds its own ``TrainingArguments`` and ``Trainer`` and
calls ``trainer.train(resume_from_checkpoint=...)`` itself."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _args import is_main_process, log, wait_for_main_process
from transformers import TrainerCallback

from hf_sparsity.callback import SparsityCallback
from hf_sparsity.export.finalize import finalize_checkpoint
from hf_sparsity.loading import load_model_folder
from hf_sparsity.modeling import sparsity_table

STAGE_DONE = "stage_done.json"


class EvalAt(TrainerCallback):
    """Evaluate at extra steps (just before and right after each event: the sawtooth's teeth)."""

    def __init__(self, steps):
        self.steps = set(steps)

    def on_step_end(self, args, state, control, **kw):
        if state.global_step in self.steps:
            control.should_evaluate = True
        return control


@dataclass
class StageResult:
    """A finished stage, as the recipe's summary, plot and ``results.json`` read it."""

    name: str
    steps: int
    final_eval_loss: float
    wall_s: float
    flops: dict[str, float]
    levels: dict[str, Any]
    events: list[dict[str, Any]] = field(default_factory=list)
    log_history: list[dict[str, Any]] = field(default_factory=list)
    model_dir: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d.pop("log_history")
        return d


def eval_every(steps: int) -> int:
    """The regular evaluation interval (``TrainingArguments.eval_steps``) for a stage of ``steps`` steps."""
    return max(steps // (4 if steps >= 40 else 2), 1)


def stage_done(args, out: str) -> StageResult | None:
    """With ``--resume``, the saved result of a stage already completed in ``out`` (else ``None``)."""
    done = Path(out) / STAGE_DONE
    if not (args.resume and done.is_file()):
        return None
    saved = json.loads(done.read_text())
    log(f"[{Path(out).name}] already done: eval loss {saved['final_eval_loss']:.4f} (from {done})")
    return StageResult(**{k: v for k, v in saved.items() if k in StageResult.__dataclass_fields__})


def record_stage(
    out: str, steps: int, eval_loss: float, metrics_cb, log_history, data, t0: float
) -> StageResult:
    """What a finished stage in ``out`` leaves for the recipe's summary, plot and ``results.json``, written
    to ``out/stage_done.json`` too (so ``--resume`` skips the stage, :func:`stage_done`). Under DDP it
    returns once the main process has written it, and ``final/`` before it, so every process may load
    ``final/`` next.

    ``metrics_cb``: the stage's :class:`SparsityCallback` (its events and measured sparsity) or
    :class:`FlopCallback`; ``log_history``: ``trainer.state.log_history``; ``data``: the stage's
    :class:`ScheduledData`; ``t0``: when the stage started (``time.time()``)."""
    out = Path(out)
    sparse = isinstance(metrics_cb, SparsityCallback)
    result = StageResult(
        name=out.name,
        steps=steps,
        final_eval_loss=float(eval_loss),
        wall_s=time.time() - t0,
        flops=metrics_cb.flops.log_dict(prefix="") if metrics_cb.flops is not None else {},
        levels=sparsity_levels(metrics_cb.engine) if sparse else {"total": 0.0},
        events=list(metrics_cb.events) if sparse else [],
        log_history=list(log_history),
        model_dir=str(out / "final"),
        data={"samples": len(data), "unique_blocks": len(set(data.order)), "segments": len(data.segments)},
    )
    if is_main_process():
        d = result.to_dict()
        d["log_history"] = result.log_history
        (out / STAGE_DONE).write_text(json.dumps(d, indent=1, default=float))
    wait_for_main_process()  # every process may load ``final/`` next: the main one has written it
    log(f"[{result.name}] done: {steps} steps, eval loss {result.final_eval_loss:.4f}, {result.wall_s:.0f}s")
    return result


def sparsity_levels(engine) -> dict[str, Any]:
    """Total and per-layer measured sparsity of the engine's targets (the library's sparsity table)."""
    rows = sparsity_table(engine.model, engine.targets, engine.masks)
    total = sum(r["zeros"] for r in rows) / max(sum(r["numel"] for r in rows), 1)
    return {"total": total, "per_layer": {r["name"]: round(r["sparsity"], 6) for r in rows}}


class StagePrinter(TrainerCallback):
    """One concise line per log, prefixed with the stage's name: a recipe lists it among its callbacks and
    removes Trainer's ``PrinterCallback`` (which would print every scalar of every log)."""

    def __init__(self, stage: str):
        self.stage = stage

    def on_log(self, args, state, control, logs=None, **kw):
        if not state.is_world_process_zero or not logs:
            return
        parts = [f"[{self.stage}] step {state.global_step:>4}"]
        for key, fmt in (
            ("loss", ".4f"),
            ("eval_loss", ".4f"),
            ("learning_rate", ".2e"),
            ("sparsity/total", ".3f"),
        ):
            if key in logs:
                parts.append(f"{key.split('/')[-1]} {logs[key]:{fmt}}")
        if len(parts) > 1:
            print("  ".join(parts), flush=True)


def finalize(model_dir: str, out_dir: str) -> str:
    """Bake the masks into zeros (``hf_sparsity convert --finalize``): a vanilla checkpoint to fine-tune."""
    if is_main_process() and not os.path.isdir(out_dir):
        finalize_checkpoint(model_dir, out_dir)
    wait_for_main_process()
    return out_dir


def load_model(path: str):
    """A stage's starting folder (an earlier stage's output), its masks applied."""
    return load_model_folder(path)[0]
