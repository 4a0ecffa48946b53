"""Native decoding steps of several models side by side in one process, alternating in short segments: tok/s
ratios that hold on a machine whose speed drifts within seconds.

    python benchmarks/step_ab.py dense=MODELS/dense:native_dense u25=OUT/models/u0.25:auto --values int8
    python benchmarks/step_ab.py a=DIR:bitmask b=DIR:native_dense --rounds 40 --segment 32

Each ``NAME=FOLDER:BACKEND`` is converted with ``sparsify_for_inference`` (the folder's masks, or the exact
zeros of a folder without a mask file) with ``--values``, then decoded greedily on the native step
(``NativeDecoder``, the screened LM head where it applies), ``--segment`` tokens at a time per model, the
models in turn, ``--rounds`` times; a model's cache starts over from a 6-token prompt before it would pass
``--positions`` (default 512: the attention over 6-511 positions; 134 is ``hf_sparsity generate``'s 128 new
tokens after a short prompt, as ``benchmarks/frontier.py`` decodes). Prints per
model the median tok/s, the bytes one step reads (``decode_bytes_per_token``), and the median and quartiles
of its per-round ratio to the first model. ``hf_sparsity generate`` and ``benchmarks/frontier.py`` measure
whole runs as a user makes them; on a shared machine whose speed changes between runs, this is the
comparison that keeps the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

PROMPT = [1, 504, 3100, 282, 260, 2214]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+", metavar="NAME=FOLDER:BACKEND")
    p.add_argument("--values", choices=["float32", "int8"], default="int8")
    p.add_argument("--rounds", type=int, default=24)
    p.add_argument("--segment", type=int, default=32, help="tokens per model per turn")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--positions", type=int, default=512, help="the cache's length: decoding restarts before it"
    )
    args = p.parse_args(argv)
    for spec in args.models:
        if "=" not in spec or ":" not in spec.split("=", 1)[1]:
            p.error(f"{spec!r}: give each model as NAME=FOLDER:BACKEND (dense=models/dense:native_dense)")
    if args.rounds < 2 or args.segment < 1:
        p.error("--rounds must be at least 2 and --segment at least 1")
    if args.positions < len(PROMPT) + args.segment:
        p.error(
            f"--positions must hold the {len(PROMPT)}-token prompt and one --segment: "
            f"at least {len(PROMPT) + args.segment}"
        )
    return args


def load(folder: str, backend: str, values: str):
    from transformers import AutoModelForCausalLM

    from hf_sparsity.inference import sparsify_for_inference
    from hf_sparsity.storage.masks_file import has_masks

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    masks = folder if has_masks(folder) else "zeros"
    return sparsify_for_inference(
        model, masks=masks, backend=backend, values=None if values == "float32" else values
    )


def main(argv=None) -> int:
    from hf_sparsity.inference.bench import decode_bytes_per_token
    from hf_sparsity.inference.native_step import NativeDecoder

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    models = {}
    for spec in args.models:
        name, rest = spec.split("=", 1)
        folder, backend = rest.rsplit(":", 1)
        models[name] = load(folder, backend, args.values)
    prompt = torch.tensor([PROMPT])
    state = {n: None for n in models}  # (decoder, position, last token)
    tok_s = {n: [] for n in models}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for name, model in models.items():
                if state[name] is None or state[name][1] + args.segment > args.positions:
                    dec = NativeDecoder(model)
                    ids = prompt % model.config.vocab_size  # (a small test vocabulary)
                    state[name] = (dec, prompt.shape[1], int(dec.start(ids, args.positions).argmax()))
                dec, pos, tok = state[name]
                t0 = time.perf_counter()
                for _ in range(args.segment):
                    tok = dec.step(tok, greedy=True)
                tok_s[name].append(args.segment / (time.perf_counter() - t0))
                state[name] = (dec, pos + args.segment, tok)
    first = next(iter(models))
    print(
        f"{args.rounds} rounds of {args.segment} tokens, {args.threads} threads, values {args.values}, "
        f"positions up to {args.positions}"
    )
    for name, model in models.items():
        ratios = [a / b for a, b in zip(tok_s[name], tok_s[first])]
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        print(
            f"{name:24s} {statistics.median(tok_s[name]):7.1f} tok/s  "
            f"{decode_bytes_per_token(model) / 2**20:8.3f} MiB/step  "
            f"x {first}: {statistics.median(ratios):.3f} (quartiles {q1:.3f}-{q3:.3f})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
