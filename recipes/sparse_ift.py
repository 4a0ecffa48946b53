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

import _common as C  # the recipes' folder: the script's own, first on sys.path
import torch
from transformers import Trainer, TrainingArguments

from hf_sparsity.callback import FlopCallback, SparsityCallback
from hf_sparsity.config import SparsityConfig, get_sparsity_config
from hf_sparsity.data import BlockDataset
from hf_sparsity.ift import sparse_ift

# ----------------------------------------------------------------------------- defaults
DEFAULTS = dict(
    output_dir="outputs/sparse_ift",
    # Sparse-IFT
    transform="wide",  # wide | parallel | factorized | doped
    sparsity=0.5,
    init_method="random",
    sparsity_seed=1234,
    # model: tiny-gpt2 (built here) | a config.json path | an HF model name or path (its config is
    # transformed)
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
    # training (each model)
    max_steps=150,
    batch_size=8,
    grad_accum=1,
    learning_rate=3e-3,
    weight_decay=0.1,
    warmup_steps=15,
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
    C.prepare_output_dir(args)
    tokenizer, train_blocks, eval_blocks = C.prepare_data(args)
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

    dense = train(
        args,
        "dense",
        dense_model,
        tokenizer,
        C.stage_data(train_blocks, args, args.max_steps, pool),
        eval_blocks,
        args.max_steps,
        FlopCallback(args.block_size),
        callbacks,
    )
    if dense.interrupted:
        return None
    metrics_cb = (
        SparsityCallback(sparsity, seq_len=args.block_size) if sparsity else FlopCallback(args.block_size)
    )
    sp = train(
        args,
        "sparse_ift",
        ift_model,
        tokenizer,
        C.stage_data(train_blocks, args, args.max_steps, pool),
        eval_blocks,
        args.max_steps,
        metrics_cb,
        callbacks,
    )
    if sp.interrupted:
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
