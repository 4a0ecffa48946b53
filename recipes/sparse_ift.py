"""Sparse-IFT: a dense model vs its iso-FLOP sparse transform, trained the same way (arXiv:2303.11525).

The transform (``wide`` by default: every projection / FFN width times 1/sqrt(1 - s),
rounded to what the heads allow; also ``parallel``, ``factorized``, ``doped``) keeps each
transformed layer's FLOPs equal to the dense original at sparsity ``s``; the whole model
differs only by the untransformed terms (attention logits, LM head), which the summary
quantifies. Both models train for the same steps on the same data order; the sparse one
with static random masks at the transform's per-layer levels.

    accelerate launch recipes/sparse_ift.py  # embedded default, ~2-4 min on a CPU
    accelerate launch recipes/sparse_ift.py --transform doped --sparsity 0.75
    accelerate launch --multi_gpu --num_processes 2 recipes/sparse_ift.py

Writes ``OUTPUT_DIR/dense/``, ``OUTPUT_DIR/sparse_ift/`` (checkpoints with masks,
``runs/`` TensorBoard logs, ``final/``), ``loss.png`` and ``results.json``.
"""

import os
import time

import _common as C  # the recipes' folder: the script's own, first on sys.path
import torch
from transformers import PrinterCallback, Trainer, TrainingArguments

from hf_sparsity import SparsityCallback, SparsityConfig, last_complete_checkpoint
from hf_sparsity.data import BlockDataset
from hf_sparsity.flops.callback import FlopCallback
from hf_sparsity.ift import sparse_ift
from hf_sparsity.logging_utils import arrange_logging
from hf_sparsity.mask_engine.config import get_sparsity_config

# ----------------------------------------------------------------------------- defaults
DEFAULTS = C.recipe_defaults(
    output_dir="outputs/sparse_ift",
    # Sparse-IFT
    transform="wide",  # wide | parallel | factorized | doped
    sparsity=0.5,
    init_method="random",
    sparsity_seed=1234,
    # model, data, training, run control: the recipes' shared defaults (recipes/_args.py); the model's
    # config is the one transformed
    # training (each model)
    max_steps=150,
    warmup_steps=15,
)
# ---------------------------------------------------------------------------------------


def train(args, name, model, tokenizer, data, eval_blocks, steps, metrics_cb, callbacks):
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
        learning_rate=args.learning_rate,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps,
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
    args, tokenizer, train_blocks, eval_blocks = C.start(DEFAULTS, __doc__, argv)
    pool = [(0, list(range(len(train_blocks))))]

    dense_model = C.build_model(args, tokenizer)
    ift = sparse_ift(dense_model.config, args.sparsity, args.transform, seq_len=args.block_size)
    torch.manual_seed(args.seed)
    ift_model = ift.build_model()
    section = get_sparsity_config(ift_model.config)
    sparsity = None
    if section is not None:
        d = section.to_dict()
        d.update(init_method=args.init_method, seed=args.sparsity_seed)
        d.pop("hf_sparsity_version", None)
        sparsity = SparsityConfig.from_dict(d)
    C.log(ift.format())

    # Both models train on the same stream, for the same steps, with the same settings.
    data = C.stage_data(train_blocks, args, args.max_steps, pool)
    dense = train(args, "dense", dense_model, tokenizer, data, eval_blocks, args.max_steps,
                  FlopCallback(args.block_size), callbacks)  # fmt: skip
    if dense is None:
        return None
    metrics_cb = (
        SparsityCallback(sparsity, seq_len=args.block_size) if sparsity else FlopCallback(args.block_size)
    )
    data = C.stage_data(train_blocks, args, args.max_steps, pool)
    sp = train(
        args, "sparse_ift", ift_model, tokenizer, data, eval_blocks, args.max_steps, metrics_cb, callbacks
    )
    if sp is None:
        return None

    whole = ift.whole_model()
    plot = C.plot_stages(
        [dense, sp],
        os.path.join(args.output_dir, "loss.png"),
        f"dense vs Sparse-IFT {args.transform} at {args.sparsity:.0%} (iso-FLOP), "
        f"{args.max_steps} steps each",
    )
    results = {
        "recipe": "sparse_ift",
        "args": vars(args),
        "stages": [dense.to_dict(), sp.to_dict()],
        "ift": ift.to_dict(),
        "dense_eval_loss": dense.final_eval_loss,
        "sparse_ift_eval_loss": sp.final_eval_loss,
        "dense_training_flops": dense.flops["train_flops"],
        "sparse_ift_training_flops": sp.flops["train_flops"],
        "inference_flops_per_token": whole["total"],
        "plot": plot,
    }
    C.write_results(os.path.join(args.output_dir, "results.json"), results)
    ratio = sp.flops["train_flops"] / dense.flops["train_flops"]
    C.log(
        f"\nSparse-IFT {args.transform} at {args.sparsity:.0%}: max per-layer FLOP deviation "
        f"{ift.max_layer_deviation:.1e}; whole-model training FLOPs {C.fmt_flops(sp.flops['train_flops'])} "
        "vs dense "
        f"{C.fmt_flops(dense.flops['train_flops'])} (x{ratio:.3f})\n"
        f"  validation loss: dense {dense.final_eval_loss:.4f}, Sparse-IFT {sp.final_eval_loss:.4f} "
        f"({sp.final_eval_loss - dense.final_eval_loss:+.4f})\n"
        f"  wall {dense.wall_s + sp.wall_s:.0f}s; results: {args.output_dir}/results.json, plot: {plot}"
    )
    return results


if __name__ == "__main__":
    main()
