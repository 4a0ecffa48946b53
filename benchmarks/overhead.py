"""Cost of SparsityCallback on a training step, measured side by side in one process.

A GPT-2-shaped model (6 layers x 512 wide, vocab 50257), AdamW with weight decay,
75% sparsity. Two identical models train in alternation: one plain, one with the
callback's optimizer-step events and gradient hooks (exactly what Trainer runs).
Prints the median step-time ratio (target <= 1.03), and mask bytes per sparsified
parameter in memory (target <= 1) and on disk (target <= 0.13).

    python benchmarks/overhead.py [--steps 20] [--seq 256] [--batch 4]
"""

import argparse
import os
import statistics
import tempfile
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerState, TrainingArguments

from hf_sparsity import SparsityCallback, SparsityConfig
from hf_sparsity.constants import SPARSITY_MASKS_NAME


def make(seed):
    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=6, n_embd=512, n_head=8, n_positions=1024, vocab_size=50257)
    model = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    return model, opt


def step(model, opt, x, cb=None, args=None, state=None, control=None):
    t0 = time.perf_counter()
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    if cb is not None:
        cb.on_pre_optimizer_step(args, state, control)
    opt.step()
    if cb is not None:
        cb.on_optimizer_step(args, state, control)
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--sparsity", type=float, default=0.75)
    a = ap.parse_args()

    dense, dense_opt = make(0)
    sparse, sparse_opt = make(0)
    tmp = tempfile.mkdtemp()
    args = TrainingArguments(output_dir=tmp, report_to=[], use_cpu=True)
    state, control = TrainerState(), None
    cb = SparsityCallback(SparsityConfig(sparsity=a.sparsity, init_method="random", seed=0))
    cb.on_train_begin(args, state, control, model=sparse, optimizer=sparse_opt)

    x = torch.randint(0, 50257, (a.batch, a.seq))
    times_d, times_s = [], []
    for i in range(a.warmup + a.steps):
        # Alternate which goes first so drift in machine load hits both equally.
        order = [(dense, dense_opt, None), (sparse, sparse_opt, cb)]
        if i % 2:
            order.reverse()
        for model, opt, c in order:
            t = step(model, opt, x, c, args, state, control)
            if i >= a.warmup:
                (times_s if c else times_d).append(t)
    med_d, med_s = statistics.median(times_d), statistics.median(times_s)
    ratios = [s / d for s, d in zip(times_s, times_d)]

    eng = cb.engine
    targeted = sum(m.numel() for m in eng.masks.values())
    storages = {}
    for t in list(eng.masks.values()) + list(eng.enforcer._dev_masks.values()):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    mem_bytes = sum(storages.values())
    eng.save(tmp)
    disk = os.path.getsize(os.path.join(tmp, SPARSITY_MASKS_NAME))

    n_params = sum(p.numel() for p in sparse.parameters())
    print(
        f"model: GPT-2 6x512, {n_params / 1e6:.1f}M params, {targeted / 1e6:.1f}M sparsified at "
        f"{a.sparsity:.0%}"
    )
    print(
        f"batch {a.batch} x seq {a.seq}, AdamW(wd=0.1), clip 1.0, {a.steps} timed steps after {a.warmup} "
        "warm-up"
    )
    print(f"dense step median:       {med_d * 1e3:8.1f} ms")
    print(f"with callback median:    {med_s * 1e3:8.1f} ms")
    print(f"ratio of medians:        {med_s / med_d:8.4f}   (target <= 1.03)")
    print(f"median per-pair ratio:   {statistics.median(ratios):8.4f}")
    print(f"mask bytes / sparsified param, in memory: {mem_bytes / targeted:.4f}   (target <= 1)")
    print(f"mask bytes / sparsified param, on disk:   {disk / targeted:.4f}   (target <= 0.13)")
    for name, mask in eng.masks.items():
        assert torch.count_nonzero(sparse.get_parameter(name).detach()[mask == 0]) == 0


if __name__ == "__main__":
    main()
