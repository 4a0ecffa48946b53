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

import _common as C  # the recipes' folder: the script's own, first on sys.path
import torch
from transformers import Trainer, TrainingArguments

from hf_sparsity import SparsityCallback, SparsityConfig
from hf_sparsity.data import BlockDataset

# ----------------------------------------------------------------------------- defaults
DEFAULTS = dict(
    output_dir="outputs/static",
    # sparsity
    sparsity=0.75,  # fraction of each projection / FFN weight set to zero
    init_method="random",  # random | topk
    sparsity_seed=1234,
    # model: tiny-gpt2 (built here) | a config.json path | an HF model name or path
    model="tiny-gpt2",
    n_embd=64,
    n_layer=2,
    n_head=4,
    vocab_size=512,
    tokenizer="",  # default: the model's own, or one trained on the data for tiny-gpt2
    # data: embedded | a .txt/.jsonl file | an HF dataset name
    dataset="embedded",
    text_column="text",
    max_texts=0,
    block_size=64,
    eval_blocks=32,
    # training
    max_steps=300,
    batch_size=8,
    grad_accum=1,
    learning_rate=3e-3,
    weight_decay=0.1,
    warmup_steps=20,
    lr_scheduler="cosine",
    logging_steps=10,
    save_steps=0,  # 0: half-way and at the end
    tensorboard=True,
    seed=0,
    # run control
    resume=False,  # continue an interrupted run in output_dir
    overwrite=False,
)
# ---------------------------------------------------------------------------------------


def main(argv=None, callbacks=()):
    """Run the recipe; ``callbacks`` go to the Trainer too (tests inject a simulated preemption)."""
    args = C.parse_args(DEFAULTS, __doc__, argv)
    C.prepare_output_dir(args)
    tokenizer, train_blocks, eval_blocks = C.prepare_data(args)
    model = C.build_model(args, tokenizer)
    data = C.stage_data(train_blocks, args, args.max_steps, [(0, list(range(len(train_blocks))))])
    out = os.path.join(args.output_dir, "train")
    stage = C.stage_done(args, out)
    if stage is None:
        sparsity = SparsityConfig(
            sparsity=args.sparsity, init_method=args.init_method, seed=args.sparsity_seed
        )
        sparsity_cb = SparsityCallback(sparsity, seq_len=args.block_size)
        training_args = TrainingArguments(
            output_dir=out,
            max_steps=args.max_steps,
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
            eval_steps=C.eval_every(args.max_steps),
            save_strategy="steps",
            save_steps=args.save_steps or max(args.max_steps // 2, 1),
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
            callbacks=[sparsity_cb, *callbacks],
        )
        stage = C.train_and_save(trainer, sparsity_cb, resume=args.resume)
    if stage.interrupted:
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
