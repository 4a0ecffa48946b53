"""One training stage of a recipe: its ``TrainingArguments`` and ``Trainer``, resuming from the last
complete checkpoint, training, evaluating, saving ``final/`` and recording the stage
(:func:`stage_done` skips a stage a resumed run already finished); finalize and reload between stages."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from _args import is_main_process, log
from _data import stage_data
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from hf_sparsity.callback import SparsityCallback
from hf_sparsity.data import BlockDataset
from hf_sparsity.export.finalize import finalize_checkpoint
from hf_sparsity.flops.callback import FlopCallback
from hf_sparsity.loading import load_model_folder
from hf_sparsity.logging_utils import move_to_front
from hf_sparsity.modeling import sparsity_table
from hf_sparsity.storage.resume import last_complete_checkpoint

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
    name: str
    steps: int
    final_eval_loss: float
    wall_s: float
    flops: dict[str, float]
    levels: dict[str, Any]
    events: list[dict[str, Any]] = field(default_factory=list)
    log_history: list[dict[str, Any]] = field(default_factory=list)
    model_dir: str = ""
    interrupted: bool = False
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d.pop("log_history")
        return d


def eval_every(steps: int) -> int:
    """The regular evaluation interval for a stage of ``steps`` optimizer steps."""
    return max(steps // (4 if steps >= 40 else 2), 1)


def stage_done(args, out: str) -> StageResult | None:
    """With ``--resume``, the saved result of a stage already completed in ``out`` (else ``None``)."""
    done = Path(out) / STAGE_DONE
    if not (args.resume and done.is_file()):
        return None
    saved = json.loads(done.read_text())
    log(f"[{Path(out).name}] already done: eval loss {saved['final_eval_loss']:.4f} (from {done})")
    return StageResult(**{k: v for k, v in saved.items() if k in StageResult.__dataclass_fields__})


def train_and_save(trainer: Trainer, metrics_cb, resume: bool) -> StageResult:
    """Run ``trainer`` (from its last complete checkpoint with ``resume``), evaluate, save ``final/``,
    record the stage. Under DDP it returns once the main process has written ``final/``, so every
    process may load it.

    ``metrics_cb``: the run's :class:`SparsityCallback` or :class:`FlopCallback`; it is moved in
    front of Trainer's own callbacks so its scalars reach TensorBoard. An interrupted run (one a
    callback stopped early) returns ``interrupted=True`` after its checkpoint.
    """
    out = Path(trainer.args.output_dir)
    name, steps, t0 = out.name, trainer.args.max_steps, time.time()
    move_to_front(trainer, metrics_cb)
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(_Printer(name))
    # The newest complete checkpoint: a run killed while saving leaves a partial newer folder.
    last = last_complete_checkpoint(out) if resume else None
    if last:
        log(f"[{name}] resuming from {last}")
    trainer.train(resume_from_checkpoint=last)
    sparse = isinstance(metrics_cb, SparsityCallback)
    events = list(metrics_cb.events) if sparse else []
    flops = metrics_cb.flops.log_dict(prefix="") if metrics_cb.flops is not None else {}
    history = list(trainer.state.log_history)
    if trainer.state.global_step < steps:
        log(
            f"[{name}] interrupted at step {trainer.state.global_step} (checkpoint saved); rerun with "
            "--resume true"
        )
        return StageResult(name, trainer.state.global_step, float("nan"), time.time() - t0, flops, {}, events,
                           history, interrupted=True)  # fmt: skip
    ev = trainer.evaluate()
    final = out / "final"
    trainer.save_model(str(final))
    if is_main_process():
        trainer.processing_class.save_pretrained(str(final))
    data = trainer.train_dataset
    result = StageResult(
        name=name,
        steps=steps,
        final_eval_loss=float(ev["eval_loss"]),
        wall_s=time.time() - t0,
        flops=flops,
        levels=sparsity_levels(metrics_cb.engine) if sparse else {"total": 0.0},
        events=events,
        log_history=history,
        model_dir=str(final),
        data={"samples": len(data), "unique_blocks": len(set(data.order)), "segments": len(data.segments)},
    )
    if is_main_process():
        d = result.to_dict()
        d["log_history"] = result.log_history
        (out / STAGE_DONE).write_text(json.dumps(d, indent=1, default=float))
    _wait_for_main_process()  # every process may load ``final/`` next: the main one has written it
    log(f"[{name}] done: {steps} steps, eval loss {result.final_eval_loss:.4f}, {result.wall_s:.0f}s")
    return result


def sparsity_levels(engine) -> dict[str, Any]:
    """Total and per-layer measured sparsity of the engine's targets (the library's sparsity table)."""
    rows = sparsity_table(engine.model, engine.targets, engine.masks)
    total = sum(r["zeros"] for r in rows) / max(sum(r["numel"] for r in rows), 1)
    return {"total": total, "per_layer": {r["name"]: round(r["sparsity"], 6) for r in rows}}


class _Printer(TrainerCallback):
    """One concise line per log (the default printer would dump every per-layer scalar)."""

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


def _wait_for_main_process() -> None:
    """Under DDP, every process waits here until the main one (which alone writes) gets here too."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def finalize(model_dir: str, out_dir: str) -> str:
    """Bake the masks into zeros (``hf_sparsity convert --finalize``): a vanilla checkpoint to fine-tune."""
    if is_main_process() and not os.path.isdir(out_dir):
        finalize_checkpoint(model_dir, out_dir)
    _wait_for_main_process()
    return out_dir


def load_model(path: str):
    """A stage's starting folder (an earlier stage's output), its masks applied."""
    return load_model_folder(path)[0]


def training_arguments(
    args, out: str, steps: int, *, learning_rate=None, warmup_steps=None, eval_steps=None
) -> TrainingArguments:
    """The ``TrainingArguments`` of one stage of ``steps`` optimizer steps written to ``out``, from the
    recipe's defaults (``args``); a stage may set its own learning rate, warm-up and evaluation interval."""
    return TrainingArguments(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size * 2,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=learning_rate or args.learning_rate,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps if warmup_steps is None else warmup_steps,
        lr_scheduler_type=args.lr_scheduler,
        max_grad_norm=1.0,
        logging_steps=args.logging_steps,
        eval_strategy="steps",
        eval_steps=eval_steps or eval_every(steps),
        save_strategy="steps",
        save_steps=args.save_steps or max(steps // 2, 1),
        save_total_limit=2,
        report_to=["tensorboard"] if args.tensorboard else [],
        seed=args.seed,
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
        include_num_input_tokens_seen=True,
        ddp_find_unused_parameters=False,
        train_sampling_strategy="sequential",  # the stream's own seeded order (resume-exact)
    )


def train_stage(
    args,
    name: str,
    model,
    tokenizer,
    data,
    eval_blocks,
    steps: int,
    metrics_cb,
    callbacks=(),
    *,
    trainer_class=Trainer,
    learning_rate=None,
    warmup_steps=None,
    eval_steps=None,
    **trainer_kwargs,
) -> StageResult:
    """One stage in ``OUTPUT_DIR/name``: its ``TrainingArguments`` (:func:`training_arguments`), a
    ``trainer_class`` (``Trainer``, or a subclass given its own ``trainer_kwargs``) with ``metrics_cb``
    first among its callbacks, then :func:`train_and_save`. A stage a resumed run already finished is
    not run again (:func:`stage_done`)."""
    out = os.path.join(args.output_dir, name)
    done = stage_done(args, out)
    if done is not None:
        return done
    trainer = trainer_class(
        model=model,
        args=training_arguments(
            args, out, steps, learning_rate=learning_rate, warmup_steps=warmup_steps, eval_steps=eval_steps
        ),
        train_dataset=data,
        eval_dataset=BlockDataset(eval_blocks),
        processing_class=tokenizer,
        callbacks=[metrics_cb, *callbacks],
        **trainer_kwargs,
    )
    return train_and_save(trainer, metrics_cb, resume=args.resume)


def dense_finetune(args, start: str, tokenizer, ft_train, ft_eval, callbacks=()) -> StageResult:
    """SPDF's last stage (``OUTPUT_DIR/finetune``): every weight of the folder ``start`` (a finalized,
    vanilla checkpoint) trained densely on the fine-tuning blocks, at ``finetune_learning_rate`` with a
    tenth of ``finetune_steps`` of warm-up, its FLOPs counted by a :class:`FlopCallback`."""
    ft_data = stage_data(ft_train, args, args.finetune_steps, [(0, list(range(len(ft_train))))])
    return train_stage(
        args,
        "finetune",
        load_model(start),
        tokenizer,
        ft_data,
        ft_eval,
        args.finetune_steps,
        FlopCallback(args.block_size),
        callbacks,
        learning_rate=args.finetune_learning_rate,
        warmup_steps=max(args.finetune_steps // 10, 1),
    )
