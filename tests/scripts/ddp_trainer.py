"""Run under ``accelerate launch --multi_gpu --num_processes 2``: Trainer + SparsityCallback on DDP (for one
architecture or several, comma-separated, one after the other).
With the mode ``fsdp`` (a third argument, or ``arch:fsdp`` in the list; under ``accelerate launch`` or
``torchrun``): ``Trainer(fsdp="full_shard", fsdp_config={"fsdp_version": 2})``, which transformers runs as DDP
on CPU; the result says how it ran.

Each rank writes ``rank{R}.json`` with a hash of its masks and of its final weights, how many
optimizer steps passed the invariant check, and the tokens its FLOP accounting counted.
"""

import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from hf_sparsity import SparsityCallback, SparsityConfig  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402
from tests.trainer_utils import InvariantChecker, end_process_group, make_trainer  # noqa: E402


def digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(out, archs, mode="ddp"):
    """``archs``: one architecture, or several separated by commas (each ``arch`` or ``arch:mode``),
    trained one after the other in the same processes (one launch), each into ``out/<arch>[-<mode>]``."""
    names = archs.split(",")
    for name in names:
        arch, _, own_mode = name.partition(":")
        run(os.path.join(out, name.replace(":", "-")) if len(names) > 1 else out, arch, own_mode or mode)
    end_process_group()


def run(out, arch, mode):
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(100 + rank)  # ranks differ in global RNG: masks must not depend on it
    model = tiny_model(arch, seed=0)
    cb = SparsityCallback(SparsityConfig(sparsity=0.75, init_method="random", seed=42))
    checker = InvariantChecker(cb)
    trainer = make_trainer(
        model,
        out,
        [cb, checker],
        max_steps=5,
        gradient_accumulation_steps=2,
        max_grad_norm=1.0,
        save_strategy="steps",
        save_steps=5,
        **({"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2}} if mode == "fsdp" else {}),
    )
    trainer.train()
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    result = {
        "world_size": world,
        "masks": digest(cb.engine.masks[k] for k in sorted(cb.engine.masks)),
        "weights": digest(p for _, p in sorted(model.named_parameters())),
        "checked_steps": checker.checked,
        "levels": sorted(set(round(v, 6) for v in cb.engine.levels.values())),
        "tokens": cb.flops.tokens,
        "fsdp_enabled": bool(trainer.is_fsdp_enabled),
        "distributed_type": str(trainer.accelerator.distributed_type),
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
