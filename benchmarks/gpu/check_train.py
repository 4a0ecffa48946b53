"""Check b: ``Trainer`` in bf16 with ``SparsityCallback`` on GPT-2-small (124M) and a Llama shape (GQA).

For each shape and each AdamW implementation (``adamw_torch_fused``, ``adamw_torch`` = foreach):
3 steps at 50% random masks with a magnitude prune to 75% at step 2; after every optimizer step a
checker (a callback after the sparsity callback, reading the parameters and the optimizer state
itself) counts masked positions that are not exactly 0 in the weights and in every weight-shaped
optimizer state tensor (AdamW's two moments). The fused runs save checkpoint-2; a fresh model then
resumes from it: the restored masks must equal the checkpoint's file and the first run's final masks
bit for bit; ``hf_sparsity convert --finalize`` of checkpoint-2 must hold exact zeros where masked.
"""

from __future__ import annotations

import os
import subprocess
import sys

import common

OPTIMIZERS = ("adamw_torch_fused", "adamw_torch")


def checker_class():
    import torch
    from transformers import TrainerCallback

    class Checker(TrainerCallback):
        """Masked positions of the weights and of AdamW's moments after every optimizer step."""

        def __init__(self, cb):
            self.cb = cb
            self.violations: list[int] = []
            self.state_tensors: list[int] = []
            self.devices: set[str] = set()

        def on_optimizer_step(self, args, state, control, optimizer=None, **kw):
            eng = self.cb.engine
            inner = getattr(optimizer, "optimizer", optimizer)
            bad = seen = 0
            for name, mask in eng.masks.items():
                p = eng.model.get_parameter(name)
                self.devices.add(f"param {p.device.type} / mask {mask.device.type}")
                bad += common.masked_nonzeros(p, mask)
                for v in inner.state.get(p, {}).values():
                    if torch.is_tensor(v) and v.shape == p.shape:
                        bad += common.masked_nonzeros(v, mask)
                        seen += 1
            self.violations.append(bad)
            self.state_tensors.append(seen)

    return Checker


def one_run(shape: str, optim: str, out: str, args, resume: str | None = None, save: bool = False):
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from hf_sparsity import SparsityCallback, SparsityConfig

    cfg = common.gpt2_config(args.tiny) if shape == "gpt2" else common.llama_config(args.tiny)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    sparsity = SparsityConfig.from_dict(
        {"sparsity": 0.5, "init_method": "random", "seed": 1234, "schedule": [{"step": 2, "sparsity": 0.75}]}
    )
    cb = SparsityCallback(sparsity)
    checker = checker_class()(cb)
    targs = TrainingArguments(
        output_dir=out, max_steps=3, per_device_train_batch_size=2 if args.tiny else 8, learning_rate=1e-3,
        weight_decay=0.1, max_grad_norm=1.0, bf16=True, optim=optim, logging_steps=1,
        save_strategy="steps" if save else "no", save_steps=2, report_to=[], seed=0, disable_tqdm=True,
        use_cpu=args.device == "cpu",
    )  # fmt: skip
    data = common.random_blocks(64, 16 if args.tiny else 256, cfg.vocab_size)
    trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[cb, checker])
    restored = None
    if resume:

        class Grab(TrainerCallback):  # the masks right after the restore, before any step
            def on_train_begin(self, a, s, c, **kw):
                nonlocal restored
                restored = {k: v.detach().cpu().clone() for k, v in cb.engine.masks.items()}

        trainer.add_callback(Grab())
    trainer.train(resume_from_checkpoint=resume)
    masks = {k: v.detach().cpu().clone() for k, v in cb.engine.masks.items()}
    return cb, checker, masks, restored


def finalize_zeros(ckpt: str, out: str, in_process: bool = False) -> tuple[int, int]:
    """``hf_sparsity convert --finalize``; (masked positions not exactly 0, masked positions). The command
    in its own process; with ``in_process`` (the dry run) its ``main`` here: the same code, no start-up."""
    from safetensors.torch import load_file

    from hf_sparsity.storage.masks_file import load_masks

    argv = ["convert", "--finalize", ckpt, out, "--no-model-card"]
    if in_process:
        from hf_sparsity.cli import main as cli_main

        if cli_main(argv):
            raise RuntimeError("convert --finalize failed")
    else:
        cmd = [sys.executable, "-m", "hf_sparsity", *argv]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ))
        if proc.returncode:
            raise RuntimeError(f"convert --finalize failed: {proc.stderr.strip()[-300:]}")
    masks, _ = load_masks(ckpt)
    weights = load_file(os.path.join(out, "model.safetensors"))
    bad = sum(common.masked_nonzeros(weights[n], m) for n, m in masks.items())
    return bad, sum(int((m == 0).sum()) for m in masks.values())


def run(report: common.Report, args) -> tuple[str, str]:
    problems = []
    shapes = args.shapes.split(",")
    for shape in shapes:
        for optim in OPTIMIZERS:
            key = f"{shape}/{optim}"
            fused = optim == "adamw_torch_fused"
            out = str(report.out / f"{shape}-{optim}")
            cb, checker, masks, _ = one_run(shape, optim, out, args, save=fused)
            kinds = [e["kind"] for e in cb.events]
            levels = sorted({round(v, 4) for v in cb.engine.levels.values()})
            report.figures[key] = {
                "violations_per_step": checker.violations,
                "state_tensors_per_step": checker.state_tensors,
                "events": kinds,
                "levels": levels,
                "where": sorted(checker.devices),
            }
            if any(checker.violations) or len(checker.violations) != 3:
                problems.append(f"{key}: masked nonzeros per step {checker.violations}")
            if not all(checker.state_tensors):
                problems.append(f"{key}: no AdamW moment of a masked weight found in a step")
            if "prune" not in kinds or levels != [0.75]:
                problems.append(f"{key}: events {kinds}, levels {levels} (expected a prune to 0.75)")
            if not fused:
                continue
            from hf_sparsity.storage.masks_file import load_masks

            ckpt = os.path.join(out, "checkpoint-2")
            saved, _ = load_masks(ckpt)
            cb2, checker2, masks2, restored = one_run(shape, optim, out + "-resumed", args, resume=ckpt)
            same_file = restored is not None and all(
                saved[k].equal(restored[k].to(saved[k].dtype)) for k in saved
            ) and saved.keys() == restored.keys()  # fmt: skip
            same_final = masks.keys() == masks2.keys() and all(masks[k].equal(masks2[k]) for k in masks)
            bad, total = finalize_zeros(ckpt, out + "-final", in_process=args.tiny)
            report.figures[key].update(
                resume_masks_identical=same_file, resumed_final_masks_identical=same_final,
                resumed_violations=checker2.violations, finalize_masked_nonzeros=bad, finalize_masked=total,
            )  # fmt: skip
            if not (same_file and same_final):
                problems.append(f"{key}: resumed masks differ (file {same_file}, final {same_final})")
            if any(checker2.violations):
                problems.append(f"{key}: after resume, masked nonzeros per step {checker2.violations}")
            if bad or not total:
                problems.append(f"{key}: finalize left {bad} of {total} masked positions nonzero")
    if problems:
        return "fail", "; ".join(problems)[:400]
    return "pass", (
        f"{' + '.join(shapes)} x fused + foreach AdamW, bf16: 0 masked nonzeros in weights and moments after "
        "every step, prune 0.5->0.75, resume bit-identical, finalize exact zeros"
    )


def extra(ap) -> None:
    ap.add_argument("--shapes", default="gpt2,llama", help="comma-separated: gpt2, llama (default both)")


if __name__ == "__main__":
    common.main(run, __doc__, extra)
