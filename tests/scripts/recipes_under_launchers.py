"""Every recipe, a few steps each, under each accelerate template in ``recipes/configs/``: a table of
exit codes, wall times and what each run reports (``results.json``).

    DS_ACCELERATOR=cpu python tests/scripts/recipes_under_launchers.py [--configs ddp_cpu zero2 zero3]
        [--recipes static spdf ...] [--out DIR]

Not part of the test suite (about a minute per run on a 2-core CPU); ``tests/test_deepspeed.py`` holds
the checks that run in CI. On a GPU machine pass ``--configs ddp_gpu zero2 zero3 fsdp2_gpu``.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# A few steps per stage: enough to cross every stage change, event and save of each recipe.
SHORT = {
    "static": ["--max_steps", "6", "--warmup_steps", "1"],
    "imp": ["--dense_steps", "4", "--rewind_to", "2", "--iterations", "2"],
    "spdf": ["--pretrain_steps", "4", "--finetune_steps", "2", "--warmup_steps", "1"],
    "variable_spdf": ["--pretrain_steps", "8", "--finetune_steps", "2", "--warmup_steps", "1"],
    "sparse_ift": ["--max_steps", "4", "--warmup_steps", "1"],
    "prune_recover": ["--dense_steps", "4", "--recover_steps", "2", "--nsamples", "4", "--max_texts", "300"],
}


def summary(results: dict) -> str:
    """The figures a recipe's ``results.json`` reports, whichever recipe wrote it."""
    keys = ("final_sparsity", "pretrain_sparsity", "sparsity", "pretrain_eval_loss", "finetune_eval_loss",
            "final_eval_loss", "dense_eval_loss", "sparse_ift_eval_loss", "gap_closed")  # fmt: skip
    parts = []
    for k in keys:
        v = results.get(k)
        if isinstance(v, int | float):
            parts.append(f"{k} {v:.4g}")
    return ", ".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["ddp_cpu", "zero2", "zero3"])
    ap.add_argument("--recipes", nargs="+", default=list(SHORT))
    ap.add_argument("--out", default=None)
    ap.add_argument("--timeout", type=int, default=900)
    a = ap.parse_args()
    out = Path(a.out or tempfile.mkdtemp(prefix="recipes_under_launchers_"))
    accelerate = [sys.executable, "-m", "accelerate.commands.launch"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    rows, failed = [], 0
    for cfg in a.configs:
        for recipe in a.recipes:
            run_dir = out / f"{cfg}-{recipe}"
            cmd = accelerate + ["--config_file", str(REPO / "recipes" / "configs" / f"{cfg}.yaml"),
                                str(REPO / "recipes" / f"{recipe}.py"), "--output_dir", str(run_dir),
                                "--overwrite", "true", *SHORT[recipe]]  # fmt: skip
            t0 = time.time()
            try:
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
                rc, log = proc.returncode, proc.stdout + proc.stderr
            except subprocess.TimeoutExpired as e:
                rc, log = "timeout", (e.stdout or b"").decode() + (e.stderr or b"").decode()
            wall = time.time() - t0
            res = run_dir / "results.json"
            figures = summary(json.loads(res.read_text())) if rc == 0 and res.is_file() else log[-300:]
            failed += rc != 0
            rows.append(f"| {cfg} | {recipe} | {rc} | {wall:.0f} s | {figures} |")
            print(rows[-1], flush=True)
    print("\n| config | recipe | exit | wall | results |\n|---|---|---|---|---|")
    print("\n".join(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
