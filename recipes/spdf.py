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

import _common as C  # the recipes' folder: the script's own, first on sys.path
import torch
from transformers import Trainer, TrainingArguments

from hf_sparsity import SparsityCallback, SparsityConfig
from hf_sparsity.callback import FlopCallback
from hf_sparsity.data import BlockDataset

# ----------------------------------------------------------------------------- defaults
DEFAULTS = dict(
    output_dir="outputs/spdf",
    # SPDF
    sparsity=0.75,  # pre-training sparsity (0: dense pre-training, the baseline)
    init_method="random",
    sparsity_seed=1234,
    pretrain_steps=250,
    finetune_steps=100,
    finetune_learning_rate=1e-3,
    finetune_dataset="embedded-d2t",  # embedded-d2t | a .txt/.jsonl file | an HF dataset name
    # model: tiny-gpt2 (built here) | a config.json path | an HF model name or path
    model="tiny-gpt2",
    n_embd=64,
    n_layer=2,
    n_head=4,
    vocab_size=512,
    tokenizer="",
    # data: embedded | a .txt/.jsonl file | an HF dataset name
    dataset="embedded",
    text_column="text",
    max_texts=0,
    block_size=64,
    eval_blocks=32,
    # training
    batch_size=8,
    grad_accum=1,
    learning_rate=3e-3,
    weight_decay=0.1,
    warmup_steps=20,
    lr_scheduler="cosine",
    logging_steps=10,
    save_steps=0,
    tensorboard=True,
    seed=0,
    # run control
    resume=False,
    overwrite=False,
)
# ---------------------------------------------------------------------------------------


def train(
    args,
    name,
    model,
    tokenizer,
    data,
    eval_blocks,
    steps,
    metrics_cb,
    callbacks=(),
    learning_rate=None,
    warmup_steps=None,
):
    """One stage: its TrainingArguments, Trainer and metrics callback, in plain view."""
    out = os.path.join(args.output_dir, name)
    done = C.stage_done(args, out)
    if done is not None:
        return done
    training_args = TrainingArguments(
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
        eval_steps=C.eval_every(steps),
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
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=data,
        eval_dataset=BlockDataset(eval_blocks),
        processing_class=tokenizer,
        callbacks=[metrics_cb, *callbacks],
    )
    return C.train_and_save(trainer, metrics_cb, resume=args.resume)


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
    pre = train(
        args, "pretrain", model, tokenizer, data, eval_blocks, args.pretrain_steps, metrics_cb, callbacks
    )
    if pre.interrupted:
        return None
    # 2. finalize: masks -> exact zeros, a vanilla checkpoint
    start = pre.model_dir
    if sparsity is not None:
        start = C.finalize(pre.model_dir, os.path.join(args.output_dir, "pretrain_finalized"))
    # 3. dense fine-tuning on the second dataset
    ft_data = C.stage_data(ft_train, args, args.finetune_steps, [(0, list(range(len(ft_train))))])
    ft = train(
        args,
        "finetune",
        C.load_model(start),
        tokenizer,
        ft_data,
        ft_eval,
        args.finetune_steps,
        FlopCallback(args.block_size),
        callbacks,
        learning_rate=args.finetune_learning_rate,
        warmup_steps=max(args.finetune_steps // 10, 1),
    )
    if ft.interrupted:
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
