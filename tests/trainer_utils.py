"""Helpers for tests that drive the real ``transformers.Trainer``."""

from __future__ import annotations

import os
import sys

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_sparsity.data import BlockDataset


def random_blocks(n: int = 64, length: int = 16, vocab: int = 128, seed: int = 0) -> BlockDataset:
    g = torch.Generator().manual_seed(seed)
    return BlockDataset(torch.randint(2, vocab, (n, length), generator=g).tolist())


def make_trainer(
    model, out_dir, callbacks, optimizers=(None, None), dataset=None, eval_dataset=None, **kw
) -> Trainer:
    args = dict(
        output_dir=str(out_dir),
        max_steps=6,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        weight_decay=0.1,
        logging_steps=100,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    args.update(kw)
    return Trainer(
        model=model,
        args=TrainingArguments(**args),
        train_dataset=dataset if dataset is not None else random_blocks(),
        eval_dataset=eval_dataset,
        callbacks=callbacks,
        optimizers=optimizers,
    )


class InvariantChecker(TrainerCallback):
    """After every optimizer step: masked weights and weight-shaped optimizer state exactly 0."""

    def __init__(self, sparsity_cb):
        self.cb = sparsity_cb
        self.checked = 0
        self.state_tensors_checked = 0

    def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
        eng = self.cb.engine
        inner = getattr(optimizer, "optimizer", optimizer)
        for name, mask in eng.masks.items():
            p = eng.model.get_parameter(name)
            off = mask == 0
            assert torch.count_nonzero(p.detach()[off]) == 0, f"{name}: masked weight revived"
            for k, v in inner.state.get(p, {}).items():
                if torch.is_tensor(v) and v.shape == p.shape:
                    assert torch.count_nonzero(v[off]) == 0, (
                        f"{name}: optimizer state {k} nonzero where masked"
                    )
                    self.state_tensors_checked += 1
        self.checked += 1


def split_runs(argv: list[str]) -> list[list[str]]:
    """A launched script's ``--then``-separated runs: ``a b --then c`` -> ``[[a, b], [c]]``."""
    runs: list[list[str]] = [[]]
    for arg in argv:
        if arg == "--then":
            runs.append([])
        else:
            runs[-1].append(arg)
    return runs


def end_process_group() -> None:
    """After a launch's last run (the results written): every rank at a barrier, the group torn down, then
    the process ends at once. Interpreter shutdown after a distributed run can abort in a C++ destructor
    ("terminate called without an active exception", a thread still joinable) and turn a finished run
    into a failed launch; ``os._exit`` skips it."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
