"""Check f: ``hf_sparsity prune --device cuda`` against the same prune on the CPU of the same machine.

A random Llama of 2 blocks at the width of a 1B model (hidden 2048, FFN 5632, 32 heads, 16 KV heads,
vocab 32000, float32, saved as a folder with a word-level tokenizer; ``--layers`` for more) is pruned to
50% by Wanda and by SparseGPT, streaming block by block (the command's default), on the GPU and on the
CPU, with the same calibration windows: the first prune by the command in its own process, the other
three by the command's ``main`` in the check's process (the same code without three more interpreter
starts and imports; each prints the seconds its pruning took, which is what is compared). A block
costs the CPU about as much as the next, so two tell the ratio that eight did, in the time the check
has. Figures: the prune time the command
prints, GPU against CPU; and the masks: every tensor must keep exactly the same number of zeros on
both devices, and the positions may differ only where float arithmetic in another order (activation
norms, the Hessian and its inverse, on another device) moves a score across the threshold: the
share of differing positions is reported, and must stay under 1%.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import common

sys.path.insert(0, str(common.REPO / "benchmarks"))

MAX_DIFFER = 0.01


def prune(model: str, out: str, method: str, run: tuple[str, bool], calib: str, n: int, seqlen: int, timeout):
    """One ``hf_sparsity prune`` command; (the prune seconds it prints, the command's wall seconds).

    In a fresh process with ``timeout`` seconds; with ``timeout`` None (every prune after the first) the
    command's ``main`` in this process: the same code, no process start.
    """
    device, streaming = run
    argv = ["prune", model, out, "--method", method, "--sparsity", "0.5", "--calib-data", calib,
            "--nsamples", str(n), "--seqlen", str(seqlen), "--device", device, "--no-progress",
            "--overwrite"]  # fmt: skip
    if not streaming:
        argv.append("--no-streaming")
    if timeout is None:
        import contextlib
        import io

        from hf_sparsity.cli import main as cli_main

        t0, printed = time.perf_counter(), io.StringIO()
        with contextlib.redirect_stdout(printed):
            rc = cli_main(argv)
        if rc:
            raise RuntimeError(f"prune --device {device} --method {method} returned {rc}")
        return _prune_seconds(printed.getvalue()), time.perf_counter() - t0
    cmd = [sys.executable, "-m", "hf_sparsity", *argv]
    env = dict(os.environ)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU side only, as a user without a GPU would run it
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout, 1), env=env)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"prune --device {device} --method {method}: {proc.stderr.strip()[-300:]}")
    return _prune_seconds(proc.stdout), wall


def _prune_seconds(printed: str) -> float:
    found = re.search(r"\(prune ([0-9.]+) s\)", printed)
    return float(found.group(1)) if found else float("nan")


def compare(a: str, b: str) -> dict:
    from hf_sparsity.storage.masks_file import load_masks

    ma, _ = load_masks(a)
    mb, _ = load_masks(b)
    if ma.keys() != mb.keys():
        return {"same_names": False}
    differ = sum(int((ma[k] != mb[k]).sum()) for k in ma)
    total = sum(m.numel() for m in ma.values())
    counts = all(int((ma[k] == 0).sum()) == int((mb[k] == 0).sum()) for k in ma)
    return {"same_names": True, "same_zero_counts": counts, "differ": differ, "differ_share": differ / total}


def run(report: common.Report, args) -> tuple[str, str]:
    from prune import build_llama, random_text

    root = report.out / "work"
    model, calib = str(root / "model"), str(root / "calib.jsonl")
    root.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    if args.tiny:
        build_llama(model, layers=2, hidden=64, ffn=176, vocab=512)
        random_text(calib, 512, docs=16, words=200)
        n, seqlen = 4, 32
    else:
        build_llama(model, layers=args.layers, hidden=2048, ffn=5632, vocab=32000)
        random_text(calib, 32000, docs=64, words=600)
        n, seqlen = 16, 256
    import json

    cfg = json.loads((root / "model" / "config.json").read_text())
    h, f, lay = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    params = lay * (2 * h * h + 2 * h * (h // 2) + 3 * h * f) + 2 * cfg["vocab_size"] * h
    report.figures["model"] = f"random Llama {lay} x {h}, FFN {f}, ~{params / 1e9:.2f}B params, float32"
    report.figures["calibration"] = f"{n} x {seqlen} tokens"
    report.figures["build_s"] = round(time.perf_counter() - t0, 1)
    deadline = time.perf_counter() + args.prune_budget
    # On the GPU: the device against the CPU, both streaming. In the CPU dry run: streaming against the
    # whole model loaded (``--no-streaming``), which must choose the same masks.
    runs = {args.device: (args.device, True), "cpu": ("cpu", True)}
    if args.device == "cpu":
        runs = {"cpu streaming": ("cpu", True), "cpu whole-model": ("cpu", False)}
    first, second = runs
    problems, times, parts = [], {}, []
    for method in ("wanda", "sparsegpt"):
        for label, how in runs.items():
            out = str(root / f"{method}-{label.replace(' ', '-')}")
            # The command starts once (that path too); the other prunes call its main in-process.
            left = None if times else deadline - time.perf_counter()
            secs, wall = prune(model, out, method, how, calib, n, seqlen, left)
            times[f"{method} {label}"] = {"prune_s": secs, "command_wall_s": round(wall, 1)}
            report.figures["times"] = times
            report.write("pass", f"partial: {times}")  # what a timeout leaves behind
        outs = [str(root / f"{method}-{label.replace(' ', '-')}") for label in runs]
        cmp = compare(*outs)
        report.figures[f"{method} masks, {first} vs {second}"] = cmp
        if not cmp.get("same_names") or not cmp.get("same_zero_counts"):
            problems.append(f"{method}: masks differ in names or zero counts ({first} vs {second})")
        elif cmp["differ_share"] > MAX_DIFFER:
            share = cmp["differ_share"]
            problems.append(f"{method}: {share:.2%} of mask positions differ (> {MAX_DIFFER:.0%})")
        a, b = times[f"{method} {first}"]["prune_s"], times[f"{method} {second}"]["prune_s"]
        share = cmp.get("differ_share", float("nan"))
        ratio = f"{b / a:.2f}x" if a > 0 else "n/a"
        parts.append(f"{method} {first} {a:.1f} s vs {second} {b:.1f} s ({ratio}), masks differ {share:.3%}")
    if problems:
        return "fail", "; ".join(problems)
    return "pass", "; ".join(parts)


def extra(ap) -> None:
    ap.add_argument("--layers", type=int, default=2, help="blocks of the random Llama (default 2)")
    ap.add_argument("--prune-budget", type=float, default=600, help="seconds for the four prunes together")


if __name__ == "__main__":
    common.main(run, __doc__, extra)
