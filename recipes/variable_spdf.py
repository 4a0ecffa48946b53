"""Variable SPDF: sparse pre-training stage 1, densify, dense stage 2, then dense fine-tuning (seed
``004_*``).

Stage 1 trains at a high sparsity (90% by default) and stage 2 continues dense, the
split chosen so the FLOP-weighted *effective* sparsity of pre-training hits a target
(75% by default: 90% sparse for 5/6 of the steps). One ``Trainer`` run with a
``densify`` event at the stage boundary (masks removed; previously masked weights start
at 0), so the LR schedule and optimizer continue across it; stage 2 draws from a pool of
blocks disjoint from stage 1's, so it never repeats stage 1's data. Then the model is
finalized and fine-tuned dense on a second dataset, as in ``spdf.py``.

    accelerate launch recipes/variable_spdf.py                       # embedded default, ~2-4 min on a CPU
    accelerate launch recipes/variable_spdf.py --output_dir runs/vspdf \
        --stage1_sparsity 0.9 --effective_sparsity 0.75
    accelerate launch --multi_gpu --num_processes 2 recipes/variable_spdf.py

Prints the effective sparsity and the pre-training FLOPs saved vs dense. Writes
``OUTPUT_DIR/pretrain/`` (checkpoints with masks, ``runs/`` TensorBoard logs),
``pretrain_finalized/``, ``finetune/``, ``loss.png`` and ``results.json``.
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
    output_dir="outputs/variable_spdf",
    # Variable SPDF
    stage1_sparsity=0.9,
    effective_sparsity=0.75,  # stage 1 lasts effective / stage1 of the pre-training steps
    init_method="random",
    sparsity_seed=1234,
    pretrain_steps=250,
    finetune_steps=100,
    finetune_learning_rate=1e-3,
    finetune_dataset="embedded-d2t",
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
    # Long by design: a recipe's story, read top to bottom (nanoGPT's train.py style).
    args = C.parse_args(DEFAULTS, __doc__, argv)
    if not 0 < args.effective_sparsity <= args.stage1_sparsity < 1:
        raise SystemExit(
            f"Need 0 < --effective_sparsity ({args.effective_sparsity}) <= --stage1_sparsity "
            f"({args.stage1_sparsity}) < 1: stage 2 is dense, so the effective level is below stage 1's."
        )
    stage1 = round(args.pretrain_steps * args.effective_sparsity / args.stage1_sparsity)
    if not 1 <= stage1 < args.pretrain_steps:
        raise SystemExit(
            f"Stage 1 would last {stage1} of {args.pretrain_steps} steps; change the levels or steps."
        )
    C.prepare_output_dir(args)
    ft_texts = C.load_texts(args.finetune_dataset, args.text_column)
    tokenizer, train_blocks, eval_blocks = C.prepare_data(args, extra_texts=ft_texts)
    ft_train, ft_eval = C.prepare_finetune(args, tokenizer, ft_texts)

    # Stage 1 and stage 2 draw from disjoint pools, sized by their share of the steps.
    cut = round(len(train_blocks) * stage1 / args.pretrain_steps)
    pools = [(0, list(range(cut))), (stage1, list(range(cut, len(train_blocks))))]
    data = C.stage_data(train_blocks, args, args.pretrain_steps, pools)
    sparsity = SparsityConfig(
        sparsity=args.stage1_sparsity,
        init_method=args.init_method,
        seed=args.sparsity_seed,
        schedule=[{"step": stage1, "densify": True}],
    )
    model = C.build_model(args, tokenizer)
    sparsity_cb = SparsityCallback(sparsity, seq_len=args.block_size)
    pre = train(
        args,
        "pretrain",
        model,
        tokenizer,
        data,
        eval_blocks,
        args.pretrain_steps,
        sparsity_cb,
        [C.EvalAt([stage1 - 1, stage1]), *callbacks],
    )
    if pre.interrupted:
        return None
    s1 = set(data.order[: stage1 * len(data) // args.pretrain_steps])
    s2 = set(data.order[stage1 * len(data) // args.pretrain_steps :])
    start = C.finalize(pre.model_dir, os.path.join(args.output_dir, "pretrain_finalized"))
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

    eff = pre.flops["effective_sparsity"]
    saved = 1.0 - pre.flops["train_flops"] / pre.flops["dense_equivalent_flops"]
    plot = C.plot_stages(
        [pre, ft],
        os.path.join(args.output_dir, "loss.png"),
        f"Variable SPDF: {args.stage1_sparsity:.0%} sparse x{stage1} steps, densify, dense x"
        f"{args.pretrain_steps - stage1} -> fine-tuning",
    )
    results = {
        "recipe": "variable_spdf",
        "args": vars(args),
        "stages": [pre.to_dict(), ft.to_dict()],
        "stage1_steps": stage1,
        "stage2_steps": args.pretrain_steps - stage1,
        "stage_data_overlap_blocks": len(s1 & s2),
        "pretrain_eval_loss": pre.final_eval_loss,
        "finetune_eval_loss": ft.final_eval_loss,
        "effective_sparsity": eff,
        "pretrain_flops": pre.flops["train_flops"],
        "pretrain_dense_equivalent_flops": pre.flops["dense_equivalent_flops"],
        "pretrain_flops_saved_fraction": saved,
        "finetune_flops": ft.flops["train_flops"],
        "plot": plot,
    }
    C.write_results(os.path.join(args.output_dir, "results.json"), results)
    C.log(
        f"\nVariable SPDF: stage 1 {args.stage1_sparsity:.0%} sparse for {stage1} steps, densify, stage 2 "
        "dense for "
        f"{args.pretrain_steps - stage1} steps (data overlap between stages: {len(s1 & s2)} blocks)\n"
        f"  effective sparsity {eff:.1%}; pre-training FLOPs {C.fmt_flops(pre.flops['train_flops'])} vs "
        "dense "
        f"{C.fmt_flops(pre.flops['dense_equivalent_flops'])}: {saved:.1%} saved "
        f"({pre.flops['flop_reduction']:.2f}x fewer)\n"
        f"  pre-training validation loss {pre.final_eval_loss:.4f}; after dense fine-tuning on "
        f"{args.finetune_dataset} ({args.finetune_steps} steps): {ft.final_eval_loss:.4f}\n"
        f"  wall {pre.wall_s + ft.wall_s:.0f}s; results: {args.output_dir}/results.json, plot: {plot}"
    )
    return results


if __name__ == "__main__":
    main()
