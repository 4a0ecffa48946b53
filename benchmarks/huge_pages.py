"""What the packed weights' huge-page buffer buys in batch-1 decoding, side by side in one run.

For each sparsity level (and int8 values where asked), the model is converted with ``auto`` (which puts
the native formats' tensors in one huge-page buffer, :mod:`hf_sparsity.backends.arena`) and deep-copied
(the copy holds ordinary tensors, each on its own 4 KiB pages). Both decode the same prompt greedily with
``greedy_decode``, interleaved round by round; printed: decoding tok/s (the tokens after the first new one
over their time) of each, medians of the rounds, and the ratio, plus the read bandwidth of a STREAM-like sum
over 256 MiB on huge pages and on ordinary memory, interleaved with the rounds.

    python benchmarks/huge_pages.py SMOLLM2_DIR --threads 2 --levels 0.5,0.7 --int8 0.5 --rounds 7
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
from decode import RANDOM, _decode_rate, _masked, build_random


def _sum_gbs(buf: torch.Tensor, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return buf.numel() * buf.element_size() / best / 1e9


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", help="a dense model folder (e.g. SmolLM2-135M-Instruct, fp32), or 'llama1b'")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--levels", default="0.5,0.7")
    p.add_argument("--int8", default="0.5", help="levels that also get an int8-values pair")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_sparsity.backends.arena import huge_buffer
    from hf_sparsity.inference import sparsify_for_inference
    from hf_sparsity.inference.decoding import greedy_decode

    if args.model_dir in RANDOM:
        dense = build_random(args.model_dir)
        ids = torch.randint(2, dense.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    else:
        dense = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
        ids = AutoTokenizer.from_pretrained(args.model_dir)("The history of the Roman Empire begins",
                                                           return_tensors="pt").input_ids  # fmt: skip
    pairs = {}
    int8 = {lv.strip() for lv in args.int8.split(",") if lv.strip()}
    for lv in [lv.strip() for lv in args.levels.split(",") if lv.strip()]:
        for values in [None] + (["int8"] if lv in int8 else []):
            model, masks = _masked(dense, lv)
            sparsify_for_inference(model, "auto", masks=masks, **({"values": values} if values else {}))
            plain = copy.deepcopy(model)  # ordinary tensors on 4 KiB pages
            name = f"{lv if lv == '2:4' else f'{float(lv):.0%}'}{' int8' if values else ''}"
            same = torch.equal(
                greedy_decode(model, ids, 16, eos_token_id=[]), greedy_decode(plain, ids, 16, eos_token_id=[])
            )
            pairs[name] = (model, plain, same)
            print(f"converted {name}", file=sys.stderr)
    del dense
    huge = huge_buffer(256 << 20).view(torch.float32).fill_(1.0)
    ordinary = torch.ones(64 << 20, dtype=torch.float32)
    bw = {"huge": [], "4k": []}
    speed = {name: ([], []) for name in pairs}
    for _ in range(args.rounds):
        bw["huge"].append(_sum_gbs(huge))
        bw["4k"].append(_sum_gbs(ordinary))
        for name, (model, plain, _) in pairs.items():
            for m, out in ((model, speed[name][0]), (plain, speed[name][1])):
                stamps: list[float] = []
                greedy_decode(
                    m,
                    ids,
                    args.tokens,
                    eos_token_id=[],
                    on_token=lambda _, s=stamps: s.append(time.perf_counter()),
                )
                out.append(_decode_rate(stamps))
    med = statistics.median
    print(
        f"{args.threads} threads, {args.tokens} tokens, medians of {args.rounds} interleaved rounds; read "
        f"bandwidth (a sum over 256 MiB) {med(bw['huge']):.1f} GB/s on huge pages, {med(bw['4k']):.1f} on "
        "ordinary memory"
    )
    print(f"{'row':<10} {'huge pages tok/s':>16} {'4 KiB pages tok/s':>17} {'ratio':>6} {'same tokens':>11}")
    for name, (_, _, same) in pairs.items():
        h, o = med(speed[name][0]), med(speed[name][1])
        print(f"{name:<10} {h:16.1f} {o:17.1f} {h / o:6.2f} {str(same):>11}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
