"""Static sparse training: masks fixed at initialization (random or magnitude), enforced every step.

    accelerate launch recipes/static.py                                  # embedded default, ~1-2 min on a CPU
    accelerate launch recipes/static.py --output_dir runs/static --sparsity 0.9 --init_method topk
    accelerate launch --multi_gpu --num_processes 2 recipes/static.py    # DDP (CPU: gloo)
    accelerate launch recipes/static.py --config my.yaml                 # overrides from YAML (keys below)
    accelerate launch recipes/static.py --model EleutherAI/pythia-70m --dataset corpus.jsonl --block_size 256

Writes ``OUTPUT_DIR/train/`` (checkpoints with ``sparsity_masks.safetensors``,
``runs/`` (TensorBoard), ``final/``), ``OUTPUT_DIR/loss.png`` and ``OUTPUT_DIR/results.json``.
"""

import os
import time

import _common as C  # the recipes' folder: the script's own, first on sys.path
import torch
from transformers import PrinterCallback, Trainer, TrainingArguments

from hf_sparsity import SparsityCallback, SparsityConfig, last_complete_checkpoint
from hf_sparsity.data import BlockDataset
from hf_sparsity.logging_utils import arrange_logging

# ----------------------------------------------------------------------------- defaults
DEFAULTS = C.recipe_defaults(
    output_dir="outputs/static",
    # sparsity
    sparsity=0.75,  # fraction of each projection / FFN weight set to zero
    init_method="random",  # random | topk
    sparsity_seed=1234,
    # model, data, training, run control: the recipes' shared defaults (recipes/_args.py), and
    max_steps=300,
)
# ---------------------------------------------------------------------------------------


def train(args, name, model, tokenizer, data, eval_blocks, steps, sparsity_cb, callbacks):
    """Training in ``OUTPUT_DIR/name``: ``steps`` optimizer steps of ``Trainer`` with ``sparsity_cb`` (a
    ``SparsityCallback``), then an evaluation and ``final/``. ``None`` if a callback stopped it early
    (after a checkpoint)."""
    out = os.path.join(args.output_dir, name)
    done = C.stage_done(args, out)  # with --resume, a run that finished already is not run again
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
        callbacks=[sparsity_cb, *callbacks, C.StagePrinter(name)],
    )
    trainer.remove_callback(PrinterCallback)  # StagePrinter prints one short line per log instead
    # Trainer puts its reporters first; sparsity_cb goes ahead of them, so TensorBoard logs the model's
    # config with its sparsity section and every sparsity/ scalar the callback adds to a log.
    arrange_logging(trainer, sparsity_cb)
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
    trainer.save_model(os.path.join(out, "final"))  # weights, masks and tokenizer
    return C.record_stage(out, steps, metrics["eval_loss"], sparsity_cb, history, data, t0)


def main(argv=None, callbacks=()):
    """Run the recipe; ``callbacks`` go to the Trainer too (tests inject a simulated preemption)."""
    args, tokenizer, train_blocks, eval_blocks = C.start(DEFAULTS, __doc__, argv)
    model = C.build_model(args, tokenizer)
    data = C.stage_data(train_blocks, args, args.max_steps, [(0, list(range(len(train_blocks))))])
    sparsity = SparsityConfig(sparsity=args.sparsity, init_method=args.init_method, seed=args.sparsity_seed)
    sparsity_cb = SparsityCallback(sparsity, seq_len=args.block_size)
    stage = train(args, "train", model, tokenizer, data, eval_blocks, args.max_steps, sparsity_cb, callbacks)
    if stage is None:
        return None
    plot = C.plot_stages(
        [stage], os.path.join(args.output_dir, "loss.png"), f"static {args.sparsity:.0%} sparse"
    )
    results = {
        "recipe": "static",
        "args": vars(args),
        "stages": [stage.to_dict()],
        "final_eval_loss": stage.final_eval_loss,
        "sparsity": stage.levels["total"],
        "training_flops": stage.flops.get("train_flops"),
        "dense_equivalent_flops": stage.flops.get("dense_equivalent_flops"),
        "plot": plot,
    }
    C.write_results(os.path.join(args.output_dir, "results.json"), results)
    C.log(
        f"\nstatic: {stage.levels['total']:.1%} sparse, {args.max_steps} steps, validation loss "
        f"{stage.final_eval_loss:.4f}; training FLOPs {C.fmt_flops(stage.flops['train_flops'])} vs dense "
        f"{C.fmt_flops(stage.flops['dense_equivalent_flops'])} ({stage.flops['flop_reduction']:.2f}x fewer); "
        f"wall {stage.wall_s:.0f}s\nresults: {args.output_dir}/results.json, plot: {plot}"
    )
    return results


if __name__ == "__main__":
    main()
