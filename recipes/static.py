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

from hf_sparsity import SparsityCallback, SparsityConfig

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


def main(argv=None, callbacks=()):
    """Run the recipe; ``callbacks`` go to the Trainer too (tests inject a simulated preemption)."""
    args, tokenizer, train_blocks, eval_blocks = C.start(DEFAULTS, __doc__, argv)
    model = C.build_model(args, tokenizer)
    data = C.stage_data(train_blocks, args, args.max_steps, [(0, list(range(len(train_blocks))))])
    sparsity = SparsityConfig(sparsity=args.sparsity, init_method=args.init_method, seed=args.sparsity_seed)
    sparsity_cb = SparsityCallback(sparsity, seq_len=args.block_size)
    stage = C.train_stage(
        args, "train", model, tokenizer, data, eval_blocks, args.max_steps, sparsity_cb, callbacks
    )
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
