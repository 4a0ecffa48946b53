"""Prune wall time and peak memory per one-shot method, each run in a fresh process.

    python benchmarks/prune.py              # a built-in 8-block Llama, random calibration
    python benchmarks/prune.py --model /work/models/smollm2/dense \\
        --calib-data ../shared/data/corpus/openwebtext-1000.jsonl --nsamples 32 --seqlen 512

Each method runs in its own subprocess (so peak RSS is that method's: model + activations +
statistics), the methods interleaved over ``--repeats`` rounds; the table gives the median prune
time, the ratio to Wanda's, and the largest peak RSS. Not a timed test: run it by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

METHODS = ("magnitude", "wanda", "sparsegpt")


def build_tiny(path: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)


def worker(a: argparse.Namespace) -> None:
    """One prune in this process; prints a JSON line with load / calibration / prune seconds and peak RSS."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_sparsity import SparsityConfig
    from hf_sparsity.pruning import prune_oneshot, read_documents, sample_calibration

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    t1 = time.perf_counter()
    if a.calib_data:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(a.model)
        calib = sample_calibration(read_documents(a.calib_data), tok, a.nsamples, a.seqlen, seed=0)
    else:
        g = torch.Generator().manual_seed(0)
        calib = torch.randint(0, model.config.vocab_size, (a.nsamples, a.seqlen), generator=g)
    t2 = time.perf_counter()
    config = SparsityConfig(sparsity=0.5, structure=a.structure or None)
    result = prune_oneshot(model, config, calib, method=a.worker, batch_size=a.batch_size)
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"method": a.worker, "load_s": t1 - t0, "calib_s": t2 - t1,
                      "prune_s": result.seconds, "peak_rss_mb": rss_kb / 1024}))  # fmt: skip


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model folder (default: a built-in 8-block Llama)")
    p.add_argument("--calib-data", help=".jsonl/.txt calibration text (default: random token ids)")
    p.add_argument("--nsamples", type=int, default=32)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--structure", default="", help='e.g. "2:4" (default unstructured 50%%)')
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        return worker(a)
    tmp = None
    if not a.model:
        tmp = tempfile.TemporaryDirectory()
        a.model = tmp.name
        build_tiny(a.model)
    runs: dict[str, list[dict]] = {m: [] for m in a.methods.split(",")}
    for _ in range(a.repeats):
        for m in runs:  # interleaved, so drifting machine load hits every method alike
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                m,
                "--model",
                a.model,
                "--nsamples",
                str(a.nsamples),
                "--seqlen",
                str(a.seqlen),
                "--batch-size",
                str(a.batch_size),
                "--structure",
                a.structure,
            ]
            if a.calib_data:
                cmd += ["--calib-data", a.calib_data]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=dict(os.environ))
            runs[m].append(json.loads(out.stdout.strip().splitlines()[-1]))
    load = os.getloadavg()
    print(f"model {a.model}; {a.nsamples} x {a.seqlen} calibration; load average {load[0]:.1f} {load[1]:.1f}")
    base = statistics.median(r["prune_s"] for r in runs.get("wanda", [])) if "wanda" in runs else None
    print(f"{'method':<10} {'prune s':>9} {'vs wanda':>9} {'load s':>7} {'peak RSS MB':>12}")
    for m, rs in runs.items():
        t = statistics.median(r["prune_s"] for r in rs)
        ratio = f"{t / base:.2f}x" if base else "-"
        load_s = statistics.median(r["load_s"] for r in rs)
        print(f"{m:<10} {t:>9.1f} {ratio:>9} {load_s:>7.1f} {max(r['peak_rss_mb'] for r in rs):>12.0f}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
