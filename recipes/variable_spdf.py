"""Variable SPDF: sparse pre-training stage 1, dense pre-training stage 2, then dense fine-tuning
(Gupta, Salem, Thangarasa, Leong, Lie, Saxena, Cerebras 2023, the Variable SPDF write-up; it
extends SPDF, Thangarasa et al. 2023, arXiv:2303.10464).

Stage 1 trains at a high sparsity (90% by default) and stage 2 continues dense, the
split chosen so the FLOP-weighted *effective* sparsity of pre-training hits a target
(75% by default: 90% sparse for 5/6 of the steps). Stage 2 draws from a pool of blocks
disjoint from stage 1's, so it never repeats stage 1's data. Two ways to run stage 2
(``--stage2_schedule``):

* ``restart`` (default, as published): stage 1 is a sparse pre-training run of its own
  (warm-up and decay over its steps); its checkpoint is converted (finalized: masks become
  exact zeros, a vanilla dense checkpoint, ``hf_sparsity convert --finalize``); stage 2 is a
  dense pre-training run of its own from it, with its own warm-up
  (``--stage2_warmup_steps``) and decay over its own steps and its own peak learning rate
  (``--stage2_learning_rate``). The optimizer starts fresh in stage 2: the conversion yields
  weights only (as the write-up's conversion utility does), stage 2 is a new run whose warm-up
  is what keeps a fresh AdamW's first steps small, and the newly trainable weights have no
  moments to carry anyway.
* ``continue``: one ``Trainer`` run with a ``densify`` event at the stage boundary (masks
  removed; previously masked weights start at 0), so one LR schedule and the optimizer
  state run across it; stage 2 falls in that schedule's tail.

Then the model is fine-tuned dense on a second dataset, as in ``spdf.py``.

    accelerate launch recipes/variable_spdf.py                       # embedded default, ~2-4 min on a CPU
    accelerate launch recipes/variable_spdf.py --output_dir runs/vspdf \
        --stage1_sparsity 0.9 --effective_sparsity 0.75 --stage2_learning_rate 3e-3
    accelerate launch recipes/variable_spdf.py --stage2_schedule continue   # the single schedule
    accelerate launch --multi_gpu --num_processes 2 recipes/variable_spdf.py

An interrupted run continues with ``--resume true`` (finished stages are skipped, the
interrupted one resumes from its last checkpoint). Prints the effective sparsity and the
pre-training FLOPs saved vs dense (both stages). Writes ``OUTPUT_DIR/stage1/`` (checkpoints
with masks), ``stage1_finalized/``, ``stage2/`` (``continue``: ``pretrain/`` and
``pretrain_finalized/`` instead), ``finetune/`` (each with ``runs/`` TensorBoard logs),
``loss.png`` and ``results.json``.
"""

import os
import time

import _common as C  # the recipes' folder: the script's own, first on sys.path
import torch
from transformers import PrinterCallback, Trainer, TrainingArguments

from hf_sparsity import SparsityCallback, SparsityConfig, last_complete_checkpoint
from hf_sparsity.data import BlockDataset
from hf_sparsity.flops.callback import FlopCallback
from hf_sparsity.logging_utils import arrange_logging

# ----------------------------------------------------------------------------- defaults
DEFAULTS = C.recipe_defaults(
    output_dir="outputs/variable_spdf",
    # Variable SPDF
    stage1_sparsity=0.9,
    effective_sparsity=0.75,  # stage 1 lasts effective / stage1 of the pre-training steps
    stage2_schedule="restart",  # restart: stage 2 its own run and LR schedule | continue: one schedule
    stage2_learning_rate=6e-3,  # restart: stage 2's peak (best of 4 after a stage 1 at 3e-3, see docs)
    stage2_warmup_steps=-1,  # restart: stage 2's warm-up (-1: a tenth of its steps, at least 1)
    init_method="random",
    sparsity_seed=1234,
    pretrain_steps=250,  # both stages
    finetune_steps=100,
    finetune_learning_rate=1e-3,
    finetune_dataset="embedded-d2t",  # embedded-d2t | a .txt/.jsonl file | an HF dataset name
    # model, data, training (learning_rate: pre-training, restart: stage 1's peak), run control:
    # the recipes' shared defaults (recipes/_args.py)
)
# ---------------------------------------------------------------------------------------


def stage_steps(args) -> tuple[int, int]:
    """Stage 1's and stage 2's steps; every bad setting refused in one line, before any training."""
    if args.stage2_schedule not in ("restart", "continue"):
        raise SystemExit(
            f"--stage2_schedule {args.stage2_schedule!r}: use restart (as published) or continue."
        )
    if not 0 < args.stage1_sparsity < 1:
        raise SystemExit(f"--stage1_sparsity {args.stage1_sparsity} is outside (0, 1); pass e.g. 0.9.")
    if args.effective_sparsity <= 0:
        raise SystemExit(
            f"--effective_sparsity {args.effective_sparsity} must be above 0 (stage 1 would last no steps); "
            "pass e.g. 0.75, or run recipes/spdf.py --sparsity 0 for dense pre-training."
        )
    if args.effective_sparsity > args.stage1_sparsity:
        raise SystemExit(
            f"--effective_sparsity {args.effective_sparsity} is above --stage1_sparsity "
            f"{args.stage1_sparsity}: stage 2 is dense, so the effective level is below stage 1's; "
            "lower it or raise --stage1_sparsity."
        )
    if args.stage2_learning_rate <= 0:
        raise SystemExit(
            f"--stage2_learning_rate {args.stage2_learning_rate} must be above 0; pass stage 2's peak "
            "learning rate, e.g. 3e-3."
        )
    stage1 = round(args.pretrain_steps * args.effective_sparsity / args.stage1_sparsity)
    if stage1 < 1:
        raise SystemExit(
            f"Stage 1 would last 0 of {args.pretrain_steps} pre-training steps; raise --pretrain_steps or "
            "--effective_sparsity."
        )
    if stage1 >= args.pretrain_steps:
        raise SystemExit(
            f"Stage 2 would last 0 of {args.pretrain_steps} pre-training steps; raise --pretrain_steps or "
            "lower --effective_sparsity below --stage1_sparsity."
        )
    return stage1, args.pretrain_steps - stage1


def train(args, name, model, tokenizer, data, eval_blocks, steps, metrics_cb, callbacks, *, learning_rate,
          warmup_steps):  # fmt: skip
    """One stage in ``OUTPUT_DIR/name``: ``steps`` optimizer steps of ``Trainer`` with ``metrics_cb`` (the
    ``SparsityCallback``, or a ``FlopCallback`` that counts a dense stage's FLOPs the same way), then an
    evaluation and ``final/``. ``None`` if a callback stopped it early (after a checkpoint)."""
    out = os.path.join(args.output_dir, name)
    done = C.stage_done(args, out)  # with --resume, a stage the interrupted run finished is not run again
    if done is not None:
        return done
    training_args = TrainingArguments(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size * 2,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=learning_rate,
        weight_decay=args.weight_decay,
        warmup_steps=warmup_steps,
        lr_scheduler_type=args.lr_scheduler,
        max_grad_norm=1.0,
        logging_steps=args.logging_steps,
        eval_strategy="steps",
        eval_steps=C.eval_every(steps),
        save_strategy="steps",
        save_steps=args.save_steps or max(steps // 2, 1),  # checkpoints: masks and FLOP count included
        save_total_limit=2,
        report_to=["tensorboard"] if args.tensorboard else [],
        seed=args.seed,
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
        include_num_input_tokens_seen=True,  # FLOPs of the tokens actually trained
        ddp_find_unused_parameters=False,
        train_sampling_strategy="sequential",  # the stream's seeded order as is: resume sees the same
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=data,
        eval_dataset=BlockDataset(eval_blocks),
        processing_class=tokenizer,
        callbacks=[metrics_cb, *callbacks, C.StagePrinter(name)],
    )
    trainer.remove_callback(PrinterCallback)  # StagePrinter prints one short line per log instead
    # Trainer puts its reporters first; metrics_cb goes ahead of them, so TensorBoard logs the model's
    # config with its sparsity section and every sparsity/ scalar metrics_cb adds to a log.
    arrange_logging(trainer, metrics_cb)
    # The newest complete checkpoint: a run killed while saving leaves a partial newer folder.
    checkpoint = last_complete_checkpoint(out) if args.resume else None
    if checkpoint:
        C.log(f"[{name}] resuming from {checkpoint}")
    t0 = time.time()
    trainer.train(resume_from_checkpoint=checkpoint)
    history = list(trainer.state.log_history)  # the training run's logs, for the plot
    if trainer.state.global_step < steps:
        step = trainer.state.global_step
        C.log(f"[{name}] interrupted at step {step} (checkpoint saved); rerun with --resume true")
        return None
    metrics = trainer.evaluate()
    trainer.save_model(os.path.join(out, "final"))  # weights, masks (a sparse stage) and tokenizer
    return C.record_stage(out, steps, metrics["eval_loss"], metrics_cb, history, data, t0)


def main(argv=None, callbacks=()):
    """Run the recipe; ``callbacks`` go to every Trainer too (tests inject a simulated preemption)."""
    # Long by design: a recipe's story, read top to bottom (nanoGPT's train.py style).
    args = C.parse_args(DEFAULTS, __doc__, argv)
    stage1, stage2 = stage_steps(args)
    C.prepare_output_dir(args)
    ft_texts = C.load_texts(args.finetune_dataset, args.text_column)
    tokenizer, train_blocks, eval_blocks = C.prepare_data(args, extra_texts=ft_texts)
    ft_train, ft_eval = C.prepare_finetune(args, tokenizer, ft_texts)

    # Stage 1 and stage 2 draw from disjoint pools, sized by their share of the steps.
    cut = round(len(train_blocks) * stage1 / args.pretrain_steps)
    pool1, pool2 = list(range(cut)), list(range(cut, len(train_blocks)))
    continue_ = args.stage2_schedule == "continue"
    sparsity = SparsityConfig(
        sparsity=args.stage1_sparsity,
        init_method=args.init_method,
        seed=args.sparsity_seed,
        schedule=[{"step": stage1, "densify": True}] if continue_ else None,
    )
    model = C.build_model(args, tokenizer)
    lr, warmup = args.learning_rate, args.warmup_steps
    if continue_:
        # One Trainer run, one LR schedule: a densify event at the stage boundary.
        data = C.stage_data(train_blocks, args, args.pretrain_steps, [(0, pool1), (stage1, pool2)])
        sparsity_cb = SparsityCallback(sparsity, seq_len=args.block_size)
        extra = [C.EvalAt([stage1 - 1, stage1]), *callbacks]  # evaluate either side of the densify event
        pre = train(args, "pretrain", model, tokenizer, data, eval_blocks, args.pretrain_steps, sparsity_cb,
                    extra, learning_rate=lr, warmup_steps=warmup)  # fmt: skip
        if pre is None:
            return None
        n1 = stage1 * len(data) // args.pretrain_steps
        seen = [data.order[:n1], data.order[n1:]]
        stages = [pre]
        start = C.finalize(pre.model_dir, os.path.join(args.output_dir, "pretrain_finalized"))
    else:
        # Stage 1: a sparse pre-training run of its own (warm-up and decay over its steps).
        data1 = C.stage_data(train_blocks, args, stage1, [(0, pool1)])
        sparsity_cb = SparsityCallback(sparsity, seq_len=args.block_size)
        s1 = train(args, "stage1", model, tokenizer, data1, eval_blocks, stage1, sparsity_cb, callbacks,
                   learning_rate=lr, warmup_steps=warmup)  # fmt: skip
        if s1 is None:
            return None
        # Convert: masks -> exact zeros, a vanilla dense checkpoint (weights only: a fresh optimizer).
        converted = C.finalize(s1.model_dir, os.path.join(args.output_dir, "stage1_finalized"))
        # Stage 2: dense pre-training of its own, its own warm-up, decay and peak LR, unseen data.
        data2 = C.stage_data(train_blocks, args, stage2, [(0, pool2)])
        warmup2 = max(stage2 // 10, 1) if args.stage2_warmup_steps < 0 else args.stage2_warmup_steps
        s2 = train(args, "stage2", C.load_model(converted), tokenizer, data2, eval_blocks, stage2,
                   FlopCallback(args.block_size), callbacks, learning_rate=args.stage2_learning_rate,
                   warmup_steps=warmup2)  # fmt: skip
        if s2 is None:
            return None
        seen = [data1.order, data2.order]
        stages = [s1, s2]
        start = s2.model_dir
    pre = stages[-1]
    overlap = len(set(seen[0]) & set(seen[1]))

    # Dense fine-tuning on the second dataset, from the dense pre-trained model.
    ft_data = C.stage_data(ft_train, args, args.finetune_steps, [(0, list(range(len(ft_train))))])
    ft = train(args, "finetune", C.load_model(start), tokenizer, ft_data, ft_eval, args.finetune_steps,
               FlopCallback(args.block_size), callbacks, learning_rate=args.finetune_learning_rate,
               warmup_steps=max(args.finetune_steps // 10, 1))  # fmt: skip
    if ft is None:
        return None

    # FLOPs over both stages. The sparsifiable layers' dense FLOPs per token are the same in
    # both, so the effective sparsity is the token-weighted mean of the stages' own (stage 2: 0).
    fl = [st.flops for st in stages]
    spent, dense = sum(f["train_flops"] for f in fl), sum(f["dense_equivalent_flops"] for f in fl)
    eff = sum(f["effective_sparsity"] * f["tokens"] for f in fl) / sum(f["tokens"] for f in fl)
    saved = 1.0 - spent / dense
    title = (
        f"Variable SPDF ({args.stage2_schedule}): {args.stage1_sparsity:.0%} sparse x{stage1} steps, dense x"
        f"{stage2} -> fine-tuning"
    )
    plot = C.plot_stages([*stages, ft], os.path.join(args.output_dir, "loss.png"), title)
    results = {
        "recipe": "variable_spdf",
        "args": vars(args),
        "stage2_schedule": args.stage2_schedule,
        "stages": [st.to_dict() for st in [*stages, ft]],
        "stage1_steps": stage1,
        "stage2_steps": stage2,
        "stage_data_overlap_blocks": overlap,
        "stage1_eval_loss": stages[0].final_eval_loss if len(stages) == 2 else None,
        "pretrain_eval_loss": pre.final_eval_loss,
        "finetune_eval_loss": ft.final_eval_loss,
        "effective_sparsity": eff,
        "pretrain_flops": spent,
        "pretrain_dense_equivalent_flops": dense,
        "pretrain_flops_saved_fraction": saved,
        "finetune_flops": ft.flops["train_flops"],
        "plot": plot,
    }
    C.write_results(os.path.join(args.output_dir, "results.json"), results)
    C.log(
        f"\nVariable SPDF ({args.stage2_schedule}): stage 1 {args.stage1_sparsity:.0%} sparse for {stage1} "
        f"steps, stage 2 dense for {stage2} steps (data overlap between stages: {overlap} blocks)\n"
        f"  effective sparsity {eff:.1%}; pre-training FLOPs {C.fmt_flops(spent)} vs dense "
        f"{C.fmt_flops(dense)}: {saved:.1%} saved ({dense / spent:.2f}x fewer)\n"
        f"  pre-training validation loss {pre.final_eval_loss:.4f}; after dense fine-tuning on "
        f"{args.finetune_dataset} ({args.finetune_steps} steps): {ft.final_eval_loss:.4f}\n"
        f"  wall {sum(st.wall_s for st in stages) + ft.wall_s:.0f}s; results: "
        f"{args.output_dir}/results.json, plot: {plot}"
    )
    return results


if __name__ == "__main__":
    main()
