"""``Trainer(deepspeed=...)`` + ``SparsityCallback`` under ``torchrun --nproc_per_node 2`` (DeepSpeed's CPU
accelerator, gloo), or in one plain process (``--stage 0``) as the reference the ZeRO runs are compared with.

Data are read in order (no shuffle). On CPU accelerate does not see DeepSpeed's ranks (it has no
CPU backend for DeepSpeed), so every rank reads the same batches and the single-process reference
takes the same batch; ZeRO still partitions the parameters, masters and moments across the ranks.
After every optimizer step a checker reads,
through DeepSpeed's public ``safe_get_full_*`` API (independent of the library's enforcement), the fp32
master weights and the Adam moments and counts the masked positions that are not exactly 0.

Each rank writes ``rank{R}.json``: losses per step, a digest of the masks, the per-step violations,
the levels, and the events.

Several runs in one launch, one after the other in the same processes (the imports and the process group
paid once), each into its own folder: ``OUT1 [options] --then OUT2 [options] ...``.
"""

import argparse
import gc
import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from torch.utils.data import SequentialSampler  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from hf_sparsity import SparsityCallback, SparsityConfig  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402
from tests.trainer_utils import end_process_group, random_blocks, split_runs  # noqa: E402

if os.environ.get("DS_ACCELERATOR") == "cpu":
    # DeepSpeed's CPU backend compiles a C++ shared-memory all-reduce (deepspeed_shm_comm) when its process
    # group starts: about 30 s on 2 cores in a fresh environment, which every launch of a test run waits
    # for. gloo's all-reduce gives the same sums; these runs check masks and state, not communication speed.
    # (by module name: the package's attribute ``deepspeed.comm.torch`` is torch itself)
    import importlib  # noqa: E402

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


class InOrderTrainer(Trainer):
    def _get_train_sampler(self, *args, **kwargs):
        return SequentialSampler(self.train_dataset)


class MasterChecker(TrainerCallback):
    """Masked positions of the fp32 master weights and of every moment, read back through DeepSpeed."""

    def __init__(self, cb):
        self.cb = cb
        self.violations: list[int] = []
        self.trace: list[str] = []  # the masks' digest after every step (events change them)
        self.lrs: list[float] = []

    def on_optimizer_step(self, args, state, control, **kwargs):
        eng = self.cb.engine
        bad = 0
        for name, mask in sorted(eng.masks.items()):
            p = eng.model.get_parameter(name)
            off = (mask == 0).reshape(-1)
            if hasattr(p, "ds_id") or hasattr(p, "_hp_mapping"):
                from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

                tensors = [safe_get_full_fp32_param(p)]
                tensors += [safe_get_full_optimizer_state(p, k) for k in ("exp_avg", "exp_avg_sq")]
            else:
                opt = kwargs["optimizer"]
                tensors = [p.detach()] + [
                    v for v in opt.state.get(p, {}).values() if torch.is_tensor(v) and v.shape == p.shape
                ]
            for t in tensors:
                if t is not None:
                    bad += int(torch.count_nonzero(t.reshape(-1)[off]))
        self.violations.append(bad)

    def on_step_end(self, args, state, control, **kwargs):
        # After the callback's own step end (events fire there, an LR rewind is applied there).
        self.trace.append(digest(self.cb.engine.masks))
        self.lrs.append(kwargs["lr_scheduler"].get_last_lr()[0])


def digest(masks):
    h = hashlib.sha256()
    for k in sorted(masks):
        h.update(k.encode())
        h.update(masks[k].contiguous().numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--init", default="random")
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--prune_at", type=int, default=0, help="a magnitude prune 0.5 -> 0.75 at this step")
    ap.add_argument(
        "--events",
        action="store_true",
        help="prune 0.5 -> 0.75 with an LR rewind at step 2, regrow to 0.6 at 4, densify at 5",
    )
    ap.add_argument("--rigl", action="store_true", help="RigL at 0.5, an update every 2 steps")
    ap.add_argument("--save_steps", type=int, default=0)
    ap.add_argument("--resume", default="")
    ap.add_argument("--offload", action="store_true")
    ap.add_argument("--universal", action="store_true", help="load a universal checkpoint (ds_to_universal)")
    a = ap.parse_args(argv)

    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(100 + rank)  # ranks differ in global RNG: masks must not depend on it
    model = tiny_model(a.arch, seed=0, hidden=64)
    cfg = dict(sparsity=a.sparsity, init_method=a.init, seed=42)
    if a.prune_at:
        cfg["schedule"] = [{"step": a.prune_at, "sparsity": 0.75}]
    if a.events:
        cfg["schedule"] = [
            {"step": 2, "sparsity": 0.75, "rewind_to": 1},
            {"step": 4, "sparsity": 0.6},
            {"step": 5, "densify": True},
        ]
    if a.rigl:
        cfg.update(algorithm="rigl", update={"freq": 2})
    cb = SparsityCallback(SparsityConfig.from_dict(cfg))
    checker = MasterChecker(cb)
    kw = dict(per_device_train_batch_size=2, gradient_accumulation_steps=1)
    if a.stage:
        zero = {"stage": a.stage, "stage3_gather_16bit_weights_on_model_save": True}
        if a.offload:
            zero["offload_optimizer"] = {"device": "cpu"}
        kw["deepspeed"] = {
            "zero_optimization": zero,
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
            "zero_allow_untested_optimizer": True,
        }
        if a.universal:
            kw["deepspeed"]["checkpoint"] = {"load_universal": True}
    else:
        # accelerate does not see DeepSpeed's CPU ranks, so each of them reads the same batches: the
        # single-process reference therefore takes the same batch, with no accumulation.
        kw.update(use_cpu=True)
    args = TrainingArguments(
        output_dir=a.out,
        max_steps=a.steps,
        learning_rate=1e-2,
        weight_decay=0.1,
        max_grad_norm=0.5,
        logging_steps=1,
        save_strategy="steps" if a.save_steps else "no",
        save_steps=a.save_steps or 500,
        report_to=[],
        seed=0,
        disable_tqdm=True,
        **kw,
    )
    trainer = InOrderTrainer(
        model=model, args=args, train_dataset=random_blocks(n=64, length=16), callbacks=[cb, checker]
    )
    trainer.train(resume_from_checkpoint=a.resume or None)
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    result = {
        "world_size": args.world_size,
        "losses": losses,
        "masks": digest(cb.engine.masks),
        "violations": checker.violations,
        "trace": checker.trace,
        "lrs": checker.lrs,
        "levels": sorted({round(v, 6) for v in cb.engine.levels.values()}),
        "events": [e["kind"] for e in cb.events],
        "restored_from": cb.restored_from,
    }
    with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def main_runs(argv: list[str]) -> None:
    """Each ``--then``-separated run in turn; the process group torn down after the last."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    for run in split_runs(argv):
        main(run)
        # The run's DeepSpeed config must not outlive it: transformers builds the next run's model inside
        # deepspeed.zero.Init while a ZeRO-3 config is alive.
        unset_hf_deepspeed_config()
        gc.collect()
    end_process_group()


if __name__ == "__main__":
    main_runs(sys.argv[1:])
