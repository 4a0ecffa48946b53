"""Prune wall time, peak memory and (optionally) WikiText-2 perplexity per one-shot variant.

    python benchmarks/prune.py              # a built-in 8-block Llama, random calibration
    python benchmarks/prune.py --model MODEL_DIR --calib-data openwebtext-1000.jsonl \\
        --nsamples 32 --seqlen 512 --wikitext2 wiki.test.raw --max-windows 64 \\
        --variants sparsegpt,sparsegpt+refit+reconstruct --sparsity 0.5
    python benchmarks/prune.py --memory-depths 4,16   # peak RSS of `hf_sparsity prune` vs depth

A variant is a method with optional ``+refit`` and ``+reconstruct``. Each runs in its own
subprocess through ``prune_folder`` (what ``hf_sparsity prune`` runs: streaming block by
block), the variants interleaved over ``--repeats`` rounds so drifting machine load hits them
alike; the table gives the median prune time, its ratio to the first variant's, the peak RSS
of the process, and the perplexity of the pruned folder. ``--memory-depths``: random Llama
models (hidden 1024, FFN 2816) of those depths, each pruned by the ``hf_sparsity prune``
command in a fresh process; the peak RSS of the whole command per depth. Not a timed test.
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

VARIANTS = ("magnitude", "wanda", "sparsegpt")


def build_llama(path: str, layers: int = 8, hidden: int = 256, ffn: int = 768, vocab: int = 4096) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 4), num_key_value_heads=max(hidden // 128, 2),
        max_position_embeddings=512,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    words = {f"w{i}": i for i in range(vocab - 1)} | {"[UNK]": vocab - 1}
    tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)


def random_text(path: str, vocab: int, docs: int = 64, words: int = 600) -> None:
    import random

    rng = random.Random(0)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(docs):
            text = " ".join(f"w{rng.randrange(vocab - 1)}" for _ in range(words))
            f.write(json.dumps({"text": text}) + "\n")


def peak_rss_mb() -> float:
    """This process's peak resident memory: ``VmHWM`` where ``/proc`` has it, else ``ru_maxrss``.

    Not ``ru_maxrss`` alone: on Linux it survives ``execve``, so a child started by
    ``subprocess`` (``vfork``) reports at least the RSS its parent had when it forked (here: the
    random model the parent just built, 1160 MB at 16 layers, whatever the child itself used).
    """
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(a: argparse.Namespace) -> None:
    """One prune in this process (``prune_folder``), then the perplexity; prints one JSON line."""
    from hf_sparsity.pruning.pipeline import prune_folder

    method, *extras = a.worker.split("+")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out")
        result = prune_folder(
            a.model, out, method=method, sparsity=None if a.structure else a.sparsity,
            structure=a.structure or None, calib_data=a.calib_data, nsamples=a.nsamples, seqlen=a.seqlen,
            batch_size=a.batch_size, refit="refit" in extras,
            reconstruct_steps=a.reconstruct_steps if "reconstruct" in extras else None,
        )  # fmt: skip
        row = {"variant": a.worker, "prune_s": result.seconds, "peak_rss_mb": peak_rss_mb()}
        if a.wikitext2:
            from hf_sparsity.evaluation.runner import evaluate_wikitext2

            ppl = evaluate_wikitext2(
                out, wikitext2_file=a.wikitext2, seqlen=a.seqlen, max_windows=a.max_windows
            )
            row["ppl"] = ppl["perplexity"]
    print(json.dumps(row))


def memory(a: argparse.Namespace) -> None:
    """Peak RSS of the whole `hf_sparsity prune` command for random Llama models of several depths."""
    code = (
        f"import json, sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
        "from prune import peak_rss_mb; from hf_sparsity.cli import main; rc = main(sys.argv[1:]); "
        "print(json.dumps({'rc': rc, 'peak_rss_mb': peak_rss_mb()}))"
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        calib = os.path.join(tmp, "calib.jsonl")
        random_text(calib, 4096)
        for depth in [int(d) for d in a.memory_depths.split(",")]:
            model = os.path.join(tmp, f"llama{depth}")
            build_llama(model, layers=depth, hidden=1024, ffn=2816)
            size = sum(os.path.getsize(os.path.join(model, f)) for f in os.listdir(model)) / 2**20
            cmd = [
                sys.executable, "-c", code, "prune", model, os.path.join(tmp, f"out{depth}"),
                "--method", a.memory_method, "--calib-data", calib, "--nsamples", str(a.nsamples),
                "--seqlen", str(a.seqlen), "--no-progress", *(["--refit"] if a.memory_refit else []),
            ]  # fmt: skip
            out = subprocess.run(cmd, check=True, capture_output=True, text=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append((depth, size, row["peak_rss_mb"]))
    print(f"hf_sparsity prune --method {a.memory_method}; {a.nsamples} x {a.seqlen} calibration")
    print(f"{'layers':>6} {'folder MB':>10} {'peak RSS MB':>12} {'vs first':>9}")
    for depth, size, rss in rows:
        print(f"{depth:>6} {size:>10.0f} {rss:>12.0f} {rss / rows[0][2]:>8.2f}x")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model folder (default: a built-in 8-block Llama)")
    p.add_argument("--calib-data", help=".jsonl/.txt calibration text (default: random words)")
    p.add_argument("--nsamples", type=int, default=32)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--sparsity", type=float, default=0.5)
    p.add_argument("--structure", default="", help='e.g. "2:4" (default unstructured --sparsity)')
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument(
        "--variants", default=",".join(VARIANTS), help="e.g. sparsegpt,sparsegpt+refit+reconstruct"
    )
    p.add_argument("--reconstruct-steps", type=int, default=None, help="default: the library's")
    p.add_argument("--wikitext2", help="wiki.test.raw: also score each pruned model (perplexity)")
    p.add_argument("--max-windows", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--memory-depths", help="e.g. 4,16: peak RSS of `hf_sparsity prune` per depth")
    p.add_argument("--memory-method", default="sparsegpt")
    p.add_argument("--memory-refit", action="store_true")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        return worker(a)
    if a.memory_depths:
        return memory(a)
    if a.reconstruct_steps is None:
        from hf_sparsity.pruning.reconstruct import DEFAULT_STEPS

        a.reconstruct_steps = DEFAULT_STEPS
    tmp = None
    if not a.model:
        tmp = tempfile.TemporaryDirectory()
        a.model = tmp.name
        build_llama(a.model)
        a.calib_data = os.path.join(tmp.name, "calib.jsonl")
        random_text(a.calib_data, 4096)
    runs: dict[str, list[dict]] = {v: [] for v in a.variants.split(",")}
    for _ in range(a.repeats):
        for v in runs:  # interleaved, so drifting machine load hits every variant alike
            cmd = [
                sys.executable, __file__, "--worker", v, "--model", a.model, "--calib-data", a.calib_data,
                "--nsamples", str(a.nsamples), "--seqlen", str(a.seqlen), "--batch-size", str(a.batch_size),
                "--sparsity", str(a.sparsity), "--structure", a.structure,
                "--reconstruct-steps", str(a.reconstruct_steps), "--max-windows", str(a.max_windows),
            ]  # fmt: skip
            if a.wikitext2:
                cmd += ["--wikitext2", a.wikitext2]
            out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
            if out.returncode:
                sys.exit(f"{v} failed:\n{out.stderr[-3000:]}")
            runs[v].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(runs[v][-1]), file=sys.stderr, flush=True)
    load = os.getloadavg()
    level = a.structure or f"{a.sparsity:.0%}"
    print(f"{level}; {a.nsamples} x {a.seqlen} calibration; load average {load[0]:.1f} {load[1]:.1f}")
    first = statistics.median(r["prune_s"] for r in next(iter(runs.values())))
    print(f"{'variant':<30} {'prune s':>9} {'vs first':>9} {'peak RSS MB':>12} {'ppl':>9}")
    for v, rs in runs.items():
        t = statistics.median(r["prune_s"] for r in rs)
        ppl = f"{statistics.median(r['ppl'] for r in rs):.3f}" if "ppl" in rs[0] else "-"
        rss = max(r["peak_rss_mb"] for r in rs)
        print(f"{v:<30} {t:>9.1f} {t / first:>8.2f}x {rss:>12.0f} {ppl:>9}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
