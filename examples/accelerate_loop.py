"""The mask engine in a plain ``accelerate`` loop: no Trainer, no callback.

``SparsityEngine.attach(optimizer)`` installs gradient hooks and optimizer step
hooks, so the usual ``backward`` / ``step`` / ``zero_grad`` loop keeps masked
weights and optimizer state exactly zero.

    python examples/accelerate_loop.py
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_loop.py   # DDP (CPU: gloo)
"""

import argparse
import math

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

from hf_sparsity import SparsityConfig, SparsityEngine
from hf_sparsity.data import BlockDataset, build_tokenizer, embedded_text, pack_tokens


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sparsity", type=float, default=0.75)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--grad_accum", type=int, default=2)
    ap.add_argument("--output_dir", default=None, help="save the model + masks here at the end")
    args = ap.parse_args()

    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum)
    torch.manual_seed(0)
    texts = embedded_text(2000)
    tokenizer = build_tokenizer(texts)
    data = BlockDataset(pack_tokens(texts, tokenizer, 64))
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=64, n_layer=2, n_head=4)
    )

    engine = SparsityEngine(model, SparsityConfig(sparsity=args.sparsity, init_method="random", seed=1234))
    engine.build_masks()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    loader = DataLoader(data, batch_size=8, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    engine.refresh()  # parameters may have moved to another device in prepare()
    engine.attach(optimizer)

    step, it = 0, iter(loader)
    while step < args.steps:
        try:
            batch = next(it)
        except StopIteration:
            it = iter(loader)
            batch = next(it)
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            step += 1
            if step % 20 == 0:
                accelerator.print(f"step {step}: loss {loss.item():.3f} (ppl {math.exp(loss.item()):.1f})")

    accelerator.print(engine.format_report())
    if args.output_dir and accelerator.is_main_process:
        engine.install_save_hook()
        accelerator.unwrap_model(model).save_pretrained(args.output_dir)


if __name__ == "__main__":
    main()
