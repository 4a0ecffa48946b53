"""Check c: the step-time cost of ``SparsityCallback`` in bf16, measured side by side in one process.

Two identical GPT-2-small models (124M) train in alternation, one plain and one with the callback's
optimizer-step events and gradient hooks (what Trainer runs), under bf16 autocast with fused AdamW,
weight decay and clipping; the order alternates every step so drift hits both alike. The figure is
the median of the per-pair step-time ratios (goal <= 1.02), eager and under ``torch.compile``
(inductor on CUDA; ``aot_eager`` in the CPU dry run, which only exercises the path). Pairs are added
until the median's spread, the width of its distribution-free 95% confidence interval (the order
statistics ``n/2 -+ 0.98 sqrt(n)`` of the sorted ratios), is under the 2% the goal judges, or the
phase's time runs out; the spread and the number of pairs are reported with the ratio. On CUDA the
host synchronizations of a step are counted with ``torch.cuda.set_sync_debug_mode`` for both models.
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
import warnings

import common

GOAL = 1.02
SPREAD = 0.02  # the median's 95% interval must be narrower than this for the ratio to judge the goal


def make(cfg, device):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    return model, opt


def step(model, opt, x, device, cb=None, hooks=(), timed=True):
    import torch

    if timed:
        common.sync(device)
    t0 = time.perf_counter()
    with torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16):
        loss = model(input_ids=x, labels=x).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    if cb is not None:
        cb.on_pre_optimizer_step(*hooks)
    opt.step()
    if cb is not None:
        cb.on_optimizer_step(*hooks)
    opt.zero_grad(set_to_none=True)
    if timed:
        common.sync(device)
    return time.perf_counter() - t0


def host_syncs(fn) -> int:
    """Synchronizing CUDA calls made by ``fn()``, counted by torch's sync debug mode (warn)."""
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def median_spread(ratios: list[float]) -> float:
    """Width of the distribution-free 95% confidence interval of the median of ``ratios`` (the sorted
    values at ranks ``n/2 -+ 0.98 sqrt(n)``); infinite below 6 values, where no such interval exists."""
    n = len(ratios)
    if n < 6:
        return math.inf
    r = sorted(ratios)
    half = 0.98 * math.sqrt(n)
    lo, hi = max(0, math.floor(n / 2 - half)), min(n - 1, math.ceil(n / 2 + half))
    return r[hi] - r[lo]


def measure(pairs, x, device, cb, hooks, warmup, min_pairs, max_pairs, seconds, spread_goal=SPREAD):
    """Interleaved pairs after ``warmup``: at least ``min_pairs``, then more until the median's spread is
    under ``spread_goal``, ``max_pairs`` were timed, or ``seconds`` passed."""
    times = {"dense": [], "sparse": []}
    ratios: list[float] = []
    t_end = None
    i = 0
    while True:
        order = list(pairs.items()) if i % 2 == 0 else list(reversed(pairs.items()))
        step_t = {}
        for kind, (model, opt) in order:
            step_t[kind] = step(model, opt, x, device, cb if kind == "sparse" else None, hooks)
        i += 1
        if i <= warmup:
            continue
        if t_end is None:
            t_end = time.perf_counter() + seconds
        for kind in times:
            times[kind].append(step_t[kind])
        ratios.append(step_t["sparse"] / step_t["dense"])
        n = len(ratios)
        enough = median_spread(ratios) < spread_goal or time.perf_counter() > t_end
        if n >= max_pairs or (n >= min_pairs and enough):
            break
    spread = median_spread(ratios)
    return {
        "dense_ms": round(statistics.median(times["dense"]) * 1e3, 3),
        "sparse_ms": round(statistics.median(times["sparse"]) * 1e3, 3),
        "median_pair_ratio": round(statistics.median(ratios), 4),
        "spread_95": round(spread, 4) if math.isfinite(spread) else None,
        "pairs": len(ratios),
        "ratio_of_medians": round(statistics.median(times["sparse"]) / statistics.median(times["dense"]), 4),
    }


def run(report: common.Report, args) -> tuple[str, str]:
    import torch
    from transformers import TrainerState, TrainingArguments

    from hf_sparsity import SparsityCallback, SparsityConfig

    device, cuda = args.device, args.device.startswith("cuda")
    cfg = common.gpt2_config(args.tiny)
    batch, seq = (2, 32) if args.tiny else (8, 512)
    # warmup, at least / at most pairs, seconds for the pairs (eager; the compiled phase has its own)
    warmup, least, most, secs = (2, 6, 8, 5.0) if args.tiny else (5, 40, 400, 12.0)
    dense, sparse = make(cfg, device), make(cfg, device)
    targs = TrainingArguments(output_dir=tempfile.mkdtemp(), report_to=[], use_cpu=not cuda)
    hooks = (targs, TrainerState(), None)
    cb = SparsityCallback(SparsityConfig(sparsity=0.75, init_method="random", seed=0))
    cb.on_train_begin(*hooks, model=sparse[0], optimizer=sparse[1])
    x = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    report.figures["shape"] = (
        f"GPT-2 {cfg.n_layer}x{cfg.n_embd}, batch {batch} x seq {seq}, bf16 autocast, fused AdamW"
    )
    eager = measure({"dense": dense, "sparse": sparse}, x, device, cb, hooks, warmup, least, most, secs)
    report.figures["eager"] = eager
    report.note(f"eager: {eager}")
    if cuda:
        report.figures["host_syncs_per_step"] = {
            "dense": host_syncs(lambda: step(*dense, x, device, timed=False)),
            "sparse": host_syncs(lambda: step(*sparse, x, device, cb, hooks, timed=False)),
        }
    report.write("pass", f"eager ratio {eager['median_pair_ratio']} (compile not measured yet)")
    backend = "inductor" if cuda else "aot_eager"
    t0 = time.perf_counter()
    compiled = {
        k: (torch.compile(m, backend=backend), o) for k, (m, o) in (("dense", dense), ("sparse", sparse))
    }
    comp = measure(compiled, x, device, cb, hooks, max(warmup, 3), least, most, secs * 0.7)
    comp["backend"] = backend
    comp["seconds_incl_compile"] = round(time.perf_counter() - t0, 1)
    report.figures["compiled"] = comp
    report.note(f"compiled: {comp}")
    for name, mask in cb.engine.masks.items():
        if common.masked_nonzeros(sparse[0].get_parameter(name), mask):
            return "fail", f"{name}: masked weights nonzero after the timed steps"
    summary = (
        f"ratio eager {eager['median_pair_ratio']} (spread {eager['spread_95']}, {eager['pairs']} pairs), "
        f"compiled ({backend}) {comp['median_pair_ratio']} "
        f"(spread {comp['spread_95']}, {comp['pairs']} pairs)"
    )
    if cuda:
        s = report.figures["host_syncs_per_step"]
        summary += f"; host syncs per step dense {s['dense']} / with callback {s['sparse']}"
        judged = {
            k: m["spread_95"] is not None and m["spread_95"] < SPREAD
            for k, m in (("eager", eager), ("compiled", comp))
        }
        wide = [k for k, ok in judged.items() if not ok]
        if eager["median_pair_ratio"] > GOAL or comp["median_pair_ratio"] > GOAL:
            return "fail", summary + f" (goal <= {GOAL})"
        if wide:
            return "fail", summary + f" ({', '.join(wide)}: spread not under {SPREAD}: not judged)"
        return "pass", summary + f" (goal <= {GOAL})"
    return "pass", summary + " (CPU dry run: no goal)"


if __name__ == "__main__":
    common.main(run, __doc__)
