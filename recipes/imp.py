"""Iterative magnitude pruning (IMP) with learning-rate rewinding (Renda et al. 2020, arXiv:2003.02389).

Train dense, then repeatedly: prune ``prune_fraction`` of the remaining weights of every
projection / FFN tensor (lowest magnitude; pruned weights stay pruned), reshuffle the
data, rewind the LR schedule to step ``rewind_to`` and retrain for ``every`` steps. The
validation loss jumps at each prune and recovers: the sawtooth of the seed's Figure 3,
drawn to ``OUTPUT_DIR/loss.png`` with the dense model's loss as the horizontal line.

    accelerate launch recipes/imp.py  # embedded default: 5 prunes to 83.2%, ~2-4 min on a CPU
    accelerate launch recipes/imp.py --output_dir runs/imp --prune_fraction 0.2 --iterations 8
    accelerate launch recipes/imp.py --dense_baseline_steps 300  # also train dense as long, to compare
    accelerate launch --multi_gpu --num_processes 2 recipes/imp.py

The LR schedule (cosine over ``dense_steps``) runs once in the dense phase; each
iteration rewinds to ``rewind_to`` and so trains ``dense_steps - rewind_to`` steps, which is
the default ``every``. Writes ``OUTPUT_DIR/imp/`` (checkpoints with masks, ``runs/``
TensorBoard logs, ``final/``), ``loss.png`` and ``results.json``.
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
from hf_sparsity.mask_engine.schedules import compile_schedule, imp_levels

# ----------------------------------------------------------------------------- defaults
DEFAULTS = C.recipe_defaults(
    output_dir="outputs/imp",
    # IMP
    prune_fraction=0.3,  # of the remaining weights, per iteration (0.2-0.33 in the seed)
    iterations=5,  # 1 - 0.7**5 = 83.2% sparse at the end
    dense_steps=100,  # dense training before the first prune (= the LR schedule's length)
    every=0,  # steps per iteration; 0: dense_steps - rewind_to
    rewind_to=60,  # LR schedule step each iteration restarts from
    dense_baseline_steps=0,  # >0: also train a dense model this long, from the same init
    sparsity_seed=1234,
    # model, data, training, run control: the recipes' shared defaults (recipes/_args.py)
    warmup_steps=10,
)
# ---------------------------------------------------------------------------------------


class RewindingTrainer(Trainer):
    """IMP's LR schedule spans the dense phase only (``lr_period`` steps); each rewind goes back into it.

    ``create_scheduler`` is Trainer's public method for a schedule of one's own.
    """

    def __init__(self, *a, lr_period: int, **kw):
        super().__init__(*a, **kw)
        self.lr_period = lr_period

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        return super().create_scheduler(self.lr_period, optimizer)


def train(args, name, model, tokenizer, data, eval_blocks, steps, metrics_cb, callbacks, *, lr_period=None,
          eval_steps=None):  # fmt: skip
    """One stage in ``OUTPUT_DIR/name``: ``steps`` optimizer steps of :class:`RewindingTrainer` (its LR
    schedule ``lr_period`` steps long, default ``steps``) with ``metrics_cb`` (the ``SparsityCallback``, or
    a ``FlopCallback`` that counts a dense stage's FLOPs the same way), then an evaluation and ``final/``.
    ``None`` if a callback stopped it early (after a checkpoint)."""
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
        eval_steps=eval_steps or C.eval_every(steps),
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
    trainer = RewindingTrainer(
        model=model,
        args=training_args,
        train_dataset=data,
        eval_dataset=BlockDataset(eval_blocks),
        processing_class=tokenizer,
        callbacks=[metrics_cb, *callbacks, C.StagePrinter(name)],
        lr_period=lr_period or steps,
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
    every = args.every or args.dense_steps - args.rewind_to
    if every <= 0:
        raise SystemExit(f"--rewind_to ({args.rewind_to}) must be below --dense_steps ({args.dense_steps}).")
    if args.rewind_to + every > args.dense_steps:
        C.log(f"note: iterations of {every} steps from step {args.rewind_to} run past the LR schedule's end")
    total = args.dense_steps + args.iterations * every
    levels = imp_levels(args.prune_fraction, args.iterations)
    C.prepare_output_dir(args)
    tokenizer, train_blocks, eval_blocks = C.prepare_data(args)
    pool = list(range(len(train_blocks)))
    spec = {
        "type": "imp",
        "prune_fraction": args.prune_fraction,
        "iterations": args.iterations,
        "dense_steps": args.dense_steps,
        "every": every,
        "rewind_to": args.rewind_to,
    }
    sparsity = SparsityConfig(sparsity=levels[-1], schedule=spec, seed=args.sparsity_seed)
    prunes = compile_schedule(sparsity, total).change_steps()
    # Evaluate just before and right after each prune, and half-way through each iteration.
    extra = sorted({s for t in prunes for s in (t - 1, t, t + every // 2)} | {args.dense_steps // 2})
    data = C.stage_data(train_blocks, args, total, [(0, pool)], reshuffle_steps=prunes)

    stages = []
    if args.dense_baseline_steps:
        dense_data = C.stage_data(train_blocks, args, args.dense_baseline_steps, [(0, pool)])
        dense_model = C.build_model(args, tokenizer)
        dense = train(args, "dense", dense_model, tokenizer, dense_data, eval_blocks,
                      args.dense_baseline_steps, FlopCallback(args.block_size), callbacks)  # fmt: skip
        if dense is None:
            return None
        stages.append(dense)
    model = C.build_model(args, tokenizer)
    sparsity_cb = SparsityCallback(sparsity, seq_len=args.block_size)
    imp_callbacks = [C.EvalAt(extra), *callbacks]
    st = train(args, "imp", model, tokenizer, data, eval_blocks, total, sparsity_cb, imp_callbacks,
               lr_period=args.dense_steps, eval_steps=every)  # fmt: skip
    if st is None:
        return None
    evals = {h["step"]: h["eval_loss"] for h in st.log_history if "eval_loss" in h}
    dense_phase = evals.get(args.dense_steps - 1)
    iterations = []
    for k, t in enumerate(prunes):
        end = prunes[k + 1] - 1 if k + 1 < len(prunes) else total
        iterations.append(
            {
                "prune_step": t,
                "level": levels[k],
                "loss_before_prune": evals.get(t - 1),
                "loss_after_prune": evals.get(t),
                "loss_end": evals.get(end, st.final_eval_loss),
            }
        )
    baseline = stages[0].final_eval_loss if stages else dense_phase
    plot = C.plot_stages(
        [st],
        os.path.join(args.output_dir, "loss.png"),
        f"IMP with LR rewinding: prune {args.prune_fraction:.0%} of the remaining weights x{args.iterations}",
        baseline=baseline,
    )
    results = {
        "recipe": "imp",
        "args": vars(args),
        "stages": [s.to_dict() for s in stages + [st]],
        "dense_phase_eval_loss": dense_phase,
        "dense_baseline_eval_loss": stages[0].final_eval_loss if stages else None,
        "final_eval_loss": st.final_eval_loss,
        "final_sparsity": st.levels["total"],
        "iterations": iterations,
        "training_flops": st.flops.get("train_flops"),
        "dense_equivalent_flops": st.flops.get("dense_equivalent_flops"),
        "plot": plot,
    }
    C.write_results(os.path.join(args.output_dir, "results.json"), results)
    lines = [
        f"\nIMP: dense {args.dense_steps} steps, then {args.iterations} x (prune, rewind to "
        f"{args.rewind_to}, {every} steps)"
    ]
    lines.append(f"  dense phase  validation loss {dense_phase:.4f}" if dense_phase is not None else "")
    for it in iterations:
        lines.append(
            f"  {it['level']:6.1%} sparse: after prune {it['loss_after_prune']:.4f} -> end of iteration "
            f"{it['loss_end']:.4f}"
        )
    if stages:
        lines.append(f"  dense baseline ({args.dense_baseline_steps} steps): {stages[0].final_eval_loss:.4f}")
    lines.append(
        f"  final: {st.levels['total']:.1%} sparse, validation loss {st.final_eval_loss:.4f} "
        f"({st.final_eval_loss - baseline:+.4f} vs dense); wall {sum(s.wall_s for s in stages + [st]):.0f}s"
    )
    lines.append(f"results: {args.output_dir}/results.json, sawtooth plot: {plot}")
    C.log("\n".join(x for x in lines if x))
    return results


if __name__ == "__main__":
    main()
