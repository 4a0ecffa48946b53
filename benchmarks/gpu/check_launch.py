"""Check d: FSDP2 and DeepSpeed ZeRO-3 through ``accelerate launch`` with the shipped templates.

    python benchmarks/gpu/check_launch.py --out DIR --backend fsdp2|zero3 [--device cpu --tiny]

Launches ``launched_trainer.py`` with ``recipes/configs/fsdp2_gpu.yaml`` or ``zero3.yaml`` and
``--num_processes 1`` (the launcher in its own process group, killed with it on a timeout), then
reads the saved checkpoint: the consolidated weights (``model.safetensors``, else DeepSpeed's
``zero_to_fp32`` of the ZeRO checkpoint) must be exactly 0 wherever the saved masks are 0, and the
saved masks must be the ones the run trained with.

What one GPU cannot show: with one rank every shard / partition is the whole tensor, so slicing a
mask at a shard boundary, masks agreeing across ranks, and gradients reduce-scattered between
ranks are not exercised here (they are on CPU, 2 processes: tests/test_fsdp2.py, test_deepspeed.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import common

CONFIGS = {"fsdp2": "fsdp2_gpu.yaml", "zero3": "zero3.yaml"}
ONE_GPU = (
    "one rank: each shard / partition is the whole tensor; no mask slicing at shard boundaries, "
    "no cross-rank mask agreement, no reduce-scatter between ranks"
)


def consolidated(ckpt: str) -> dict:
    from safetensors.torch import load_file

    path = os.path.join(ckpt, "model.safetensors")
    if os.path.isfile(path):
        return load_file(path)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(ckpt)


def run(report: common.Report, args) -> tuple[str, str]:
    from hf_sparsity.storage.masks_file import load_masks

    cfg = common.REPO / "recipes" / "configs" / CONFIGS[args.backend]
    out = report.out / "run"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(cfg), "--num_processes",
           "1", str(common.REPO / "benchmarks" / "gpu" / "launched_trainer.py"), str(out)]  # fmt: skip
    if args.tiny:
        cmd.append("--tiny")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(common.REPO), os.environ.get("PYTHONPATH", "")]))
    if args.device == "cpu":
        env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    report.figures["config"] = f"recipes/configs/{cfg.name}, --num_processes 1"
    with open(report.out / "launch.log", "w") as log:
        # In this check's process group: gpu_check.py ends the group, and sweeps torchrun's workers
        # (sessions of their own) by the marker in their environment.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            rc = proc.wait(timeout=args.launch_timeout)
        except subprocess.TimeoutExpired:
            rc = None
            proc.terminate()  # torchrun passes it on to its workers
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    if rc != 0:
        tail = (report.out / "launch.log").read_text(errors="replace").strip().splitlines()[-3:]
        why = f"timed out after {args.launch_timeout} s" if rc is None else f"exited {rc}"
        return "fail", f"accelerate launch {why}: {' | '.join(tail)[-300:]}"
    r = json.loads((out / "launched.json").read_text())
    report.figures.update(r)
    report.figures["one_gpu_cannot_show"] = ONE_GPU
    problems = []
    if any(r["violations_per_step"]) or not all(r["tensors_checked_per_step"]):
        problems.append(f"masked nonzeros per step {r['violations_per_step']}")
    if "prune" not in r["events"] or r["levels"] != [0.75]:
        problems.append(f"events {r['events']}, levels {r['levels']}")
    masks, _ = load_masks(r["checkpoint"])
    from launched_trainer import digest

    if digest(masks) != r["masks_digest"]:
        problems.append("the checkpoint's masks are not the ones the run trained with")
    weights = consolidated(r["checkpoint"])
    missing = [n for n in masks if n not in weights]
    bad = sum(common.masked_nonzeros(weights[n], m) for n, m in masks.items() if n in weights)
    report.figures["consolidated_masked_nonzeros"] = bad
    if missing:
        problems.append(f"{len(missing)} masked tensors missing from the consolidated weights")
    if bad:
        problems.append(f"{bad} masked positions nonzero in the consolidated weights")
    expected = {"fsdp2": "DTensor shards", "zero3": "deepspeed partitions"}[args.backend]
    where = f"{r['distributed_type']}, {', '.join(r['sharded']) or 'unsharded'}"
    if args.device.startswith("cuda") and expected not in r["sharded"]:
        problems.append(f"the run was not sharded ({where})")
    if problems:
        return "fail", f"{where}: " + "; ".join(problems)
    return "pass", (
        f"{where}: 0 masked nonzeros in weights and moments over {len(r['violations_per_step'])} steps, "
        f"prune to 0.75, consolidated checkpoint exact ({ONE_GPU.split(';')[0]})"
    )


def extra(ap) -> None:
    ap.add_argument("--backend", choices=sorted(CONFIGS), required=True)
    ap.add_argument("--launch-timeout", type=int, default=600, help="seconds for accelerate launch")


if __name__ == "__main__":
    common.main(run, __doc__, extra)
