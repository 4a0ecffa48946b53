"""SPDF: Sparse Pre-training and Dense Fine-tuning (Thangarasa et al. 2023, arXiv:2303.10464).

1. **Sparse pre-training**: static unstructured sparsity (random masks, 75% by default) on
   every projection / FFN weight, enforced on every optimizer step.
2. **Finalize**: masks baked into exact zeros, a vanilla checkpoint
   (``hf_sparsity convert --finalize``).
3. **Dense fine-tuning** on a second dataset: every weight trainable again, the
   previously masked ones starting from 0. The default second task is a small
   structured data-to-text set (a tiny DART), embedded like the pre-training text.

    accelerate launch recipes/spdf.py --output_dir outputs/spdf  # the README's main job, ~2-4 min on a CPU
    accelerate launch recipes/spdf.py --sparsity 0                     # dense pre-training: the baseline
    accelerate launch --multi_gpu --num_processes 2 recipes/spdf.py    # DDP (CPU: gloo)
    accelerate launch recipes/spdf.py --model EleutherAI/pythia-70m --dataset corpus.jsonl \\
        --finetune_dataset task.jsonl --block_size 256

An interrupted run continues with ``--resume true``: finished stages are skipped, the
interrupted one resumes from its last checkpoint (bit-identical on CPU), and the
fine-tuning stage only ever sees the fine-tuning data. Writes ``OUTPUT_DIR/pretrain/``,
``pretrain_finalized/``, ``finetune/`` (each with ``runs/`` TensorBoard logs),
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
    output_dir="outputs/spdf",
    # SPDF
    sparsity=0.75,  # pre-training sparsity (0: dense pre-training, the baseline)
    init_method="random",
    sparsity_seed=1234,
    pretrain_steps=250,
    finetune_steps=100,
    finetune_learning_rate=1e-3,
    finetune_dataset="embedded-d2t",  # embedded-d2t | a .txt/.jsonl file | an HF dataset name
    # model, data, training, run control: the recipes' shared defaults (recipes/_args.py)
)
# ---------------------------------------------------------------------------------------


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
    args = C.parse_args(DEFAULTS, __doc__, argv)
    C.prepare_output_dir(args)
    ft_texts = C.load_texts(args.finetune_dataset, args.text_column)
    tokenizer, train_blocks, eval_blocks = C.prepare_data(args, extra_texts=ft_texts)
    ft_train, ft_eval = C.prepare_finetune(args, tokenizer, ft_texts)

    # 1. sparse pre-training
    sparsity = None
    if args.sparsity > 0:
        sparsity = SparsityConfig(
            sparsity=args.sparsity, init_method=args.init_method, seed=args.sparsity_seed
        )
    data = C.stage_data(train_blocks, args, args.pretrain_steps, [(0, list(range(len(train_blocks))))])
    model = C.build_model(args, tokenizer)
    metrics_cb = (
        SparsityCallback(sparsity, seq_len=args.block_size) if sparsity else FlopCallback(args.block_size)
    )
    pre = train(args, "pretrain", model, tokenizer, data, eval_blocks, args.pretrain_steps, metrics_cb,
                callbacks, learning_rate=args.learning_rate, warmup_steps=args.warmup_steps)  # fmt: skip
    if pre is None:
        return None
    # 2. finalize: masks -> exact zeros, a vanilla checkpoint
    start = pre.model_dir
    if sparsity is not None:
        start = C.finalize(pre.model_dir, os.path.join(args.output_dir, "pretrain_finalized"))
    # 3. dense fine-tuning on the second dataset: every weight trainable, its FLOPs counted the same way
    ft_data = C.stage_data(ft_train, args, args.finetune_steps, [(0, list(range(len(ft_train))))])
    ft = train(args, "finetune", C.load_model(start), tokenizer, ft_data, ft_eval, args.finetune_steps,
               FlopCallback(args.block_size), callbacks, learning_rate=args.finetune_learning_rate,
               warmup_steps=max(args.finetune_steps // 10, 1))  # fmt: skip
    if ft is None:
        return None

    label = f"SPDF {args.sparsity:.0%} sparse pre-training" if sparsity else "dense pre-training"
    plot = C.plot_stages(
        [pre, ft], os.path.join(args.output_dir, "loss.png"), f"{label} -> dense fine-tuning"
    )
    saved = pre.flops["dense_equivalent_flops"] - pre.flops["train_flops"]
    results = {
        "recipe": "spdf",
        "args": vars(args),
        "stages": [pre.to_dict(), ft.to_dict()],
        "pretrain_eval_loss": pre.final_eval_loss,
        "finetune_eval_loss": ft.final_eval_loss,
        "pretrain_sparsity": pre.levels["total"],
        "pretrain_flops": pre.flops["train_flops"],
        "pretrain_dense_equivalent_flops": pre.flops["dense_equivalent_flops"],
        "pretrain_flops_saved_fraction": saved / pre.flops["dense_equivalent_flops"],
        "finetune_flops": ft.flops["train_flops"],
        "plot": plot,
    }
    C.write_results(os.path.join(args.output_dir, "results.json"), results)
    C.log(
        f"\nSPDF: pre-training {pre.levels['total']:.1%} sparse, {args.pretrain_steps} steps -> validation "
        "loss "
        f"{pre.final_eval_loss:.4f}\n"
        f"  pre-training FLOPs {C.fmt_flops(pre.flops['train_flops'])} vs dense "
        f"{C.fmt_flops(pre.flops['dense_equivalent_flops'])} "
        f"({results['pretrain_flops_saved_fraction']:.1%} saved)\n"
        f"  dense fine-tuning on {args.finetune_dataset}, {args.finetune_steps} steps -> validation loss "
        f"{ft.final_eval_loss:.4f}\n"
        f"  wall {pre.wall_s + ft.wall_s:.0f}s; results: {args.output_dir}/results.json, plot: {plot}"
    )
    return results


if __name__ == "__main__":
    main()
