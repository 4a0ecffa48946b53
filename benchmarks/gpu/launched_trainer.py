"""The training script check d launches under ``accelerate launch --config_file recipes/configs/X.yaml``.

    accelerate launch --config_file recipes/configs/zero3.yaml --num_processes 1 \\
        benchmarks/gpu/launched_trainer.py OUT [--tiny] [--steps 4]

``Trainer`` + ``SparsityCallback`` (50% random masks, a magnitude prune to 75% at step 2) on a Llama
shape. After every optimizer step a checker gathers each masked parameter and its AdamW moments
through the framework's own API (FSDP2: ``DTensor.full_tensor()``; DeepSpeed: ``safe_get_full_*``,
and the rank's own partition of the working weight) and counts masked positions that are not
exactly 0. The last step is saved; ``OUT/launched.json`` holds what the run saw.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402


def digest(masks) -> str:
    h = hashlib.sha256()
    for k in sorted(masks):
        h.update(k.encode())
        h.update(masks[k].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def gathered(p, opt_state) -> list:
    """The parameter and its weight-shaped optimizer state, whole, however the framework holds them."""
    import torch

    if hasattr(p, "ds_id"):  # DeepSpeed ZeRO-3 (and the ZeRO-1/2 hp mapping below)
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        out = [safe_get_full_fp32_param(p)]
        out += [safe_get_full_optimizer_state(p, k) for k in ("exp_avg", "exp_avg_sq")]
        import torch.distributed as dist

        if getattr(p, "ds_tensor", None) is not None and (
            not dist.is_initialized() or dist.get_world_size() == 1
        ):
            out.append(p.ds_tensor.narrow(0, 0, p.ds_numel).view(p.ds_shape))  # one rank: the whole weight
        return [t for t in out if t is not None]
    out = [p]
    out += [
        v for v in opt_state.get(p, {}).values() if torch.is_tensor(v) and tuple(v.shape) == tuple(p.shape)
    ]
    return out


def skip_deepspeed_cpu_comm_build() -> None:
    """The CPU dry run: DeepSpeed's CPU backend compiles a C++ shared-memory all-reduce
    (``deepspeed_shm_comm``) when its process group starts, about 30 s on 2 cores in a fresh
    environment; gloo's all-reduce gives the same sums, and the dry run checks code paths, not speed."""
    import importlib

    try:  # by module name: the package's attribute ``deepspeed.comm.torch`` is torch itself
        ds_comm = importlib.import_module("deepspeed.comm.torch")
    except ImportError:  # no DeepSpeed: the zero3 check is skipped anyway
        return
    ds_comm.build_shm_op = lambda: None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from hf_sparsity import SparsityCallback, SparsityConfig

    if not torch.cuda.is_available():
        skip_deepspeed_cpu_comm_build()
    cfg = common.llama_config(a.tiny)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    cb = SparsityCallback(
        SparsityConfig.from_dict(
            {
                "sparsity": 0.5,
                "init_method": "random",
                "seed": 1234,
                "schedule": [{"step": 2, "sparsity": 0.75}],
            }
        )
    )
    seen = {"violations": [], "checked": [], "sharded": set()}

    class Checker(TrainerCallback):
        def on_optimizer_step(self, args, state, control, optimizer=None, **kw):
            eng = cb.engine
            inner = getattr(optimizer, "optimizer", optimizer)
            opt_state = getattr(inner, "state", {})
            bad = n = 0
            for name, mask in eng.masks.items():
                p = eng.model.get_parameter(name)
                if hasattr(p, "ds_id"):
                    seen["sharded"].add("deepspeed partitions")
                elif hasattr(p, "full_tensor"):
                    seen["sharded"].add("DTensor shards")
                for t in gathered(p, opt_state):
                    bad += common.masked_nonzeros(t, mask)
                    n += 1
            seen["violations"].append(bad)
            seen["checked"].append(n)

    targs = TrainingArguments(
        output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=2 if a.tiny else 8,
        learning_rate=1e-3, weight_decay=0.1, max_grad_norm=1.0, logging_steps=1, save_strategy="steps",
        save_steps=a.steps, report_to=[], seed=0, disable_tqdm=True,
    )  # fmt: skip
    data = common.random_blocks(64, 16 if a.tiny else 256, cfg.vocab_size)
    trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[cb, Checker()])
    trainer.train()
    acc = trainer.accelerator
    result = {
        "distributed_type": str(acc.distributed_type),
        "num_processes": acc.num_processes,
        "fsdp_version": getattr(getattr(acc.state, "fsdp_plugin", None), "fsdp_version", None),
        "deepspeed_stage": (acc.state.deepspeed_plugin.zero_stage if acc.state.deepspeed_plugin else None),
        "mixed_precision": str(acc.mixed_precision),
        "sharded": sorted(seen["sharded"]),
        "violations_per_step": seen["violations"],
        "tensors_checked_per_step": seen["checked"],
        "events": [e["kind"] for e in cb.events],
        "levels": sorted({round(v, 4) for v in cb.engine.levels.values()}),
        "masks_digest": digest(cb.engine.masks),
        "checkpoint": os.path.join(a.out, f"checkpoint-{a.steps}"),
    }
    if trainer.is_world_process_zero():
        with open(os.path.join(a.out, "launched.json"), "w") as f:
            json.dump(result, f, indent=1)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
