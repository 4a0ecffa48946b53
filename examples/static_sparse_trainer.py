"""Static sparse training of a tiny GPT-2 with ``transformers.Trainer`` + ``SparsityCallback``.

Runs on a CPU in about a minute with no network and no data files:
the text and the tokenizer are built in-process (``hf_sparsity.data``).

    python examples/static_sparse_trainer.py                      # 75% random, 200 steps
    python examples/static_sparse_trainer.py --sparsity 0.9 --init_method topk --max_steps 100

Writes checkpoints (with ``sparsity_masks.safetensors``) and the final model to
``--output_dir`` and prints the per-layer sparsity at the end.
"""

import argparse

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from hf_sparsity import SparsityCallback, SparsityConfig
from hf_sparsity.data import BlockDataset, build_tokenizer, embedded_text, pack_tokens
from hf_sparsity.storage.folders import format_inspection, inspect_checkpoint


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output_dir", default="outputs/static_sparse")
    ap.add_argument("--sparsity", type=float, default=0.75)
    ap.add_argument("--init_method", default="random", choices=["random", "topk"])
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--max_steps", type=int, default=200)
    ap.add_argument("--block_size", type=int, default=64)
    args = ap.parse_args()

    texts = embedded_text()
    tokenizer = build_tokenizer(texts)
    blocks = pack_tokens(texts, tokenizer, args.block_size)
    n_val = max(len(blocks) // 20, 8)
    train, val = BlockDataset(blocks[n_val:]), BlockDataset(blocks[:n_val])

    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=args.block_size,
        n_embd=128,
        n_layer=4,
        n_head=4,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = GPT2LMHeadModel(config)
    sparsity = SparsityConfig(sparsity=args.sparsity, init_method=args.init_method, seed=args.seed)

    targs = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=16,
        learning_rate=3e-3,
        weight_decay=0.1,
        warmup_steps=20,
        lr_scheduler_type="cosine",
        logging_steps=25,
        save_steps=max(args.max_steps // 2, 1),
        eval_strategy="steps",
        eval_steps=max(args.max_steps // 2, 1),
        report_to=[],
        seed=args.seed,
        use_cpu=True,
    )
    trainer = Trainer(
        model=model,
        args=targs,
        train_dataset=train,
        eval_dataset=val,
        callbacks=[SparsityCallback(sparsity)],
    )
    trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model(args.output_dir)
    tokenizer.save_pretrained(args.output_dir)
    print(f"\nvalidation loss {metrics['eval_loss']:.4f}; model + masks saved to {args.output_dir}")
    print(format_inspection(inspect_checkpoint(args.output_dir)))


if __name__ == "__main__":
    main()
