"""Decoding speed as users run it: ``hf_sparsity generate``,
``model.generate(custom_generate=native_generate)`` (greedy and sampling), the text-generation ``pipeline``
and transformers' own loop, beside the native loop
(``greedy_decode``), on pruned model folders, with WikiText-2 perplexity and bytes per weight.

    python benchmarks/decode_user.py wanda50=OUT/wanda50 wanda70=OUT/wanda70 wanda50+int8=OUT/wanda50:int8 \\
        --threads 2 --tokens 128 --rounds 3 --ppl-windows 16 --data-dir DATA_DIR

Each ``NAME=FOLDER[:int8]`` is a model folder (``hf_sparsity prune`` output: weights and
``sparsity_masks.safetensors``; ``:int8``: int8 values with per-row scales). Per folder the model is loaded
once and converted with ``sparsify_for_inference(model, "auto")``; the rows (one prompt, batch 1):

* ``native loop``: :func:`hf_sparsity.inference.decoding.greedy_decode` (one native call per token);
* ``generate+native``: ``model.generate(ids, do_sample=False, custom_generate=native_generate)``;
* ``generate+native, sampling``: the same with ``do_sample=True, temperature=0.7, top_k=50, top_p=0.9,
  repetition_penalty=1.1``;
* ``pipeline+native``: ``pipeline("text-generation", model=model, tokenizer=tok)(prompt,
  custom_generate=native_generate)``, greedy;
* ``generate (transformers loop)``: ``model.generate`` without ``custom_generate`` (the forward per token);
* ``hf_sparsity generate``: the command (a subprocess, ``--no-dense``; once per folder, after the rounds): the
  tok/s it prints, and the loop it says ran.

The in-process rows run interleaved over ``--rounds`` (every row once per round), every one forced to
``--tokens`` new tokens (``min_new_tokens``); the table gives medians of the decoding rate: the new tokens
after the first over their time (the prompt's processing excluded), the quantity ``benchmarks/decode.py`` and
``hf_sparsity generate`` report. ``bytes/weight``: the converted projections' resident bytes over their
weight count (dense float32: 4); ``MB/token``: the bytes of weights one decoded token reads.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

import torch
from decode import _decode_rate as _rate  # the rate benchmarks/decode.py reports
from decode import _Stamps

SAMPLING = dict(do_sample=True, temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.1)


def _cli(folder: str, values: str | None, args) -> tuple[float | None, str]:
    cmd = [
        sys.executable, "-c", "import sys; from hf_sparsity.cli import main; sys.exit(main(sys.argv[1:]))",
        "generate", folder, "--prompt", args.prompt, "--max-new-tokens", str(args.tokens), "--no-dense",
        "--threads", str(args.threads),
    ]  # fmt: skip
    if values:
        cmd += ["--values", values]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    m = re.search(r"\[auto: ([0-9.]+) tok/s", res.stderr)
    loop = re.search(r"loop: (.*?)(?:;|\]|$)", res.stderr)
    if m is None:
        return None, res.stderr.strip().splitlines()[-1] if res.stderr.strip() else f"rc {res.returncode}"
    return float(m.group(1)), loop.group(1) if loop else "?"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+", help="NAME=FOLDER or NAME=FOLDER:int8")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ppl-windows", type=int, default=0, help="WikiText-2 windows (seqlen 512); 0: skip")
    p.add_argument("--data-dir", default=None, help="folder holding text/wikitext-2-raw/wiki.test.raw")
    p.add_argument("--prompt", default="The history of the Roman Empire begins")
    p.add_argument("--no-cli", action="store_true", help="skip the hf_sparsity generate rows")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    import hf_sparsity
    from hf_sparsity.evaluation.wikitext2 import wikitext2_perplexity
    from hf_sparsity.inference import sparse_layer_bytes, sparsify_for_inference
    from hf_sparsity.inference.bench import decode_bytes_per_token
    from hf_sparsity.inference.decoding import greedy_decode, native_generate, native_step_reason

    load0 = os.getloadavg()
    models = {}
    for item in args.models:
        name, _, spec = item.partition("=")
        folder, _, values = spec.partition(":")
        tok = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        t = time.perf_counter()
        sparsify_for_inference(model, "auto", **({"values": values} if values else {}))
        convert_s = time.perf_counter() - t
        ids = tok(args.prompt, return_tensors="pt").input_ids
        reason = native_step_reason(model, ids.shape[1] + args.tokens)
        print(f"{name}: converted in {convert_s:.1f} s; native step: {reason or 'yes'}", file=sys.stderr)
        models[name] = dict(model=model, tok=tok, ids=ids, folder=folder, values=values or None)
    n = args.tokens

    def rows_for(m):
        model, tok, ids = m["model"], m["tok"], m["ids"]
        pipe = pipeline("text-generation", model=model, tokenizer=tok)
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        common = dict(max_new_tokens=n, min_new_tokens=n, pad_token_id=pad)

        def native_loop():
            stamps: list[float] = []
            greedy_decode(
                model, ids, n, eos_token_id=[], on_token=lambda _: stamps.append(time.perf_counter())
            )
            return _rate(stamps)

        def gen(extra):
            def run():
                s = _Stamps()
                model.generate(ids, attention_mask=torch.ones_like(ids), streamer=s, **common, **extra)
                return _rate(s.calls[1:])

            return run

        def pipe_run():
            s = _Stamps()
            pipe(args.prompt, streamer=s, do_sample=False, custom_generate=native_generate, **common)
            return _rate(s.calls[1:])

        return {
            "native loop": native_loop,
            "generate+native": gen({"do_sample": False, "custom_generate": native_generate}),
            "generate+native, sampling": gen({**SAMPLING, "custom_generate": native_generate}),
            "pipeline+native": pipe_run,
            "generate (transformers loop)": gen({"do_sample": False}),
        }

    runs = {(name, row): fn for name, m in models.items() for row, fn in rows_for(m).items()}
    speeds: dict[tuple, list[float]] = {k: [] for k in runs}
    with torch.inference_mode():
        for fn in runs.values():  # warm-up
            fn()
        for _ in range(args.rounds):
            for k, fn in runs.items():
                speeds[k].append(fn())
    ppl, bpw, mbt = {}, {}, {}
    data = args.data_dir or os.environ.get("HF_SPARSITY_SHARED_DATA", "shared/data")
    for name, m in models.items():
        layers = sparse_layer_bytes(m["model"])
        bpw[name] = 4 * layers["ratio"]  # the dense projections are float32
        mbt[name] = decode_bytes_per_token(m["model"]) / 1e6
        if args.ppl_windows:
            path = os.path.join(data, "text", "wikitext-2-raw", "wiki.test.raw")
            with torch.inference_mode():
                res = wikitext2_perplexity(
                    m["model"], m["tok"], path, seqlen=512, max_windows=args.ppl_windows
                )
                ppl[name] = res["perplexity"]
    cli = {}
    if not args.no_cli:
        for name, m in models.items():
            cli[name] = _cli(m["folder"], m["values"], args)
    print(
        f"\nhf_sparsity {hf_sparsity.__version__}, torch {torch.__version__}, {args.threads} threads; "
        f"{n} new tokens after a {next(iter(models.values()))['ids'].shape[1]}-token prompt, medians of "
        f"{args.rounds} interleaved rounds; load average before {load0[0]:.1f}, "
        f"after {os.getloadavg()[0]:.1f}"
    )
    print(f"{'model':<14} {'row':<30} {'tok/s':>7} {'x native loop':>13} {'ppl':>7} {'bytes/weight':>12} "
          f"{'MB/token':>8}")  # fmt: skip
    results = []
    for name in models:
        base = statistics.median(speeds[(name, "native loop")])
        table = [(row, statistics.median(speeds[(name, row)])) for (nm, row) in runs if nm == name]
        if name in cli:
            table.append(("hf_sparsity generate", cli[name][0]))
        for row, v in table:
            cells = f"{v:7.1f} {v / base:13.2f}" if v else f"{'-':>7} {'-':>13}"
            pp = f"{ppl[name]:7.2f}" if name in ppl else f"{'-':>7}"
            print(f"{name:<14} {row:<30} {cells} {pp} {bpw[name]:12.2f} {mbt[name]:8.1f}")
            results.append(
                dict(model=name, row=row, tok_s=v, rounds=speeds.get((name, row)), ppl=ppl.get(name),
                     bytes_per_weight=bpw[name], mb_per_token=mbt[name])
            )  # fmt: skip
        if name in cli:
            print(f"{'':<14} hf_sparsity generate's loop: {cli[name][1]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "tokens": n, "rows": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
