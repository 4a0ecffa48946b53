"""LoRA fine-tuning of a sparse model that stays sparse, end to end, offline, in well under a minute.

1. make a small sparse model (60% random masks) and save it: weights + sparsity_masks.safetensors;
2. load it, wrap it with a peft LoRA adapter, fine-tune in ``Trainer`` with ``SparsityCallback``
   (``lora: masked``: the adapter's update is applied as (B·A) ⊙ M, so merging cannot fill the zeros);
3. ``merge_sparse``: merged model with exact masks, saved with its mask file;
4. ``finalize_checkpoint``: a vanilla folder for the Hub, with a model card.

    python examples/lora_sparse.py --out OUT_DIR
"""

from __future__ import annotations

import argparse
import os

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainingArguments

from hf_sparsity import SparsityCallback, SparsityConfig, SparsityEngine, finalize_checkpoint, merge_sparse
from hf_sparsity.data import BlockDataset
from hf_sparsity.storage.folders import format_inspection, inspect_checkpoint


def make_sparse_model(path: str) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = AutoModelForCausalLM.from_config(config)
    engine = SparsityEngine(model, SparsityConfig(sparsity=0.6, init_method="random", seed=1))
    engine.build_masks()
    engine.apply()
    engine.install_save_hook()  # save_pretrained writes the masks and the config's sparsity section
    model.save_pretrained(path)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="folder the example writes its models into")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--mode", choices=["masked", "merge_then_mask"], default="masked")
    args = parser.parse_args()
    base_dir = os.path.join(args.out, "sparse-base")
    make_sparse_model(base_dir)

    model = AutoModelForCausalLM.from_pretrained(base_dir)
    model = get_peft_model(
        model,
        LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]),
    )
    # The callback finds the masks in the folder the base came from (config.name_or_path).
    callback = SparsityCallback(SparsityConfig(sparsity=0.6, lora=args.mode))
    g = torch.Generator().manual_seed(0)
    data = BlockDataset(torch.randint(2, 256, (64, 32), generator=g).tolist())
    trainer = Trainer(
        model=model,
        args=TrainingArguments(
            output_dir=os.path.join(args.out, "run"),
            max_steps=args.steps,
            per_device_train_batch_size=8,
            learning_rate=3e-3,
            logging_steps=5,
            save_strategy="no",
            report_to=[],
            include_num_input_tokens_seen=True,  # FLOPs from the real 32-token blocks
            use_cpu=True,
            disable_tqdm=True,
        ),
        train_dataset=data,
        callbacks=[callback],
    )
    trainer.train()

    merged_dir = os.path.join(args.out, "merged")
    merged = merge_sparse(model, output_dir=merged_dir, overwrite=True)
    zeros = sum(int((merged.get_parameter(n) == 0).sum()) for n in callback.engine.masks)
    total = sum(m.numel() for m in callback.engine.masks.values())
    print(f"merged: {zeros / total:.2%} of the {total:,} sparsified weights are exactly 0")

    final_dir = os.path.join(args.out, "final")
    finalize_checkpoint(merged_dir, final_dir, overwrite=True)
    print(format_inspection(inspect_checkpoint(final_dir)).splitlines()[-1])
    print(f"model card: {os.path.join(final_dir, 'README.md')}")


if __name__ == "__main__":
    main()
