"""Does ``auto`` make the same plan every time, even beside a competing job? And how long does it take?

    python benchmarks/auto_stability.py MODEL_DIR --threads 2 --level 0.5 --runs 5 --busy-run 3

Converts the model ``--runs`` times with the plan cache off (every run measures), run ``--busy-run``
beside a competing job (a separate process multiplying matrices on ``--threads`` threads), then once more
with the plan cache on, twice (the second run reads the cache). Prints each run's plan (decode format
per layer group, and whether the whole-model check kept it), its conversion time, and whether every
plan is the same.
"""

from __future__ import annotations

import argparse
import copy
import multiprocessing as mp
import os
import sys
import tempfile
import time

import torch


def _busy(threads: int, stop) -> None:
    torch.set_num_threads(threads)
    a = torch.randn(1024, 1024)
    while not stop.is_set():
        a = torch.tanh(a @ a)


def _plan(model) -> tuple:
    from hf_sparsity.inference import auto_choices

    choices = auto_choices(model)
    # the LM head's choice has no group (None): sort on strings
    groups = sorted({(c.get("group"), c["decode"], c["prefill"]) for c in choices.values()}, key=str)
    kept = next(iter(choices.values())).get("whole_model_check", {}).get("kept")
    return tuple(groups), kept


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--level", type=float, default=0.5)
    p.add_argument("--values", default=None, choices=(None, "int8"))
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--busy-run", type=int, default=3, help="which run (1-based) has a competing job; 0: none")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from hf_sparsity.inference import sparsify_for_inference
    from hf_sparsity.mask_engine.config import SparsityConfig
    from hf_sparsity.mask_engine.engine import SparsityEngine

    dense = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    eng = SparsityEngine(dense, SparsityConfig(sparsity=args.level, init_method="topk"))
    eng.build_masks()
    eng.apply()
    masks = {n: m.clone() for n, m in eng.masks.items()}
    opts = {"values": args.values} if args.values else {}
    plans = []
    print(f"load average {os.getloadavg()[0]:.1f}; {args.threads} threads; {args.level:.0%}; {args.values}")
    os.environ["HF_SPARSITY_PLAN_CACHE"] = os.path.join(tempfile.mkdtemp(), "plans.json")
    runs = [(i + 1, False) for i in range(args.runs)] + [(args.runs + 1, True), (args.runs + 2, True)]
    for i, cached in runs:
        busy = i == args.busy_run
        ctx = mp.get_context("spawn")  # a fork would inherit torch's OpenMP state
        stop = ctx.Event()
        job = ctx.Process(target=_busy, args=(args.threads, stop)) if busy else None
        if job is not None:
            job.start()
            time.sleep(1.0)
        model = copy.deepcopy(dense)
        t = time.perf_counter()
        sparsify_for_inference(model, "auto", masks=masks, plan_cache=cached, **opts)
        dt = time.perf_counter() - t
        if job is not None:
            stop.set()
            job.join()
        plan = _plan(model)
        plans.append(plan)
        label = "cache" if cached else ("beside a 2-thread job" if busy else "measured")
        print(f"run {i} ({label}): {dt:5.1f} s, whole-model check kept: {plan[1]}")
        for g in plan[0]:
            print(f"    {g[0] or 'LM head':<36} decode {g[1]:<12} prefill {g[2]}")
        del model
    same = all(p == plans[0] for p in plans)
    print(f"same plan in all {len(plans)} conversions: {same}; load average {os.getloadavg()[0]:.1f}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
