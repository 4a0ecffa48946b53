"""``hf_sparsity bench``: time a sparse backend against dense, one layer or a whole model's decoding.

One layer (interleaved dense / backend timings, medians; error against the emulator)::

    hf_sparsity bench --backend csr --sparsity 0.9 --shape 768x3072 --batch 1 --json

Whole-model decoding (tokens/s, dense vs backend, interleaved rounds, medians)::

    hf_sparsity bench --model DIR --backend csr            # masks from DIR/sparsity_masks.safetensors
    hf_sparsity bench --model DIR --backend csr --masks zeros   # finalized checkpoint: its exact zeros
    hf_sparsity bench --model DIR --backend emulator       # + the modeled speedup of the dataflow machine

``ratio`` is ``dense_ms / backend_ms`` (above 1: the backend is faster). The library code is in
:mod:`hf_sparsity.inference.bench` (imported when the command runs).
"""

# Lazy imports: a subcommand imports the library when it runs, so `--help` and the others start fast.

from __future__ import annotations

import contextlib
import json
import sys
from typing import Any

import torch

from ..utils import SparsityError


# ---------------------------------------------------------------------------- CLI
def _print_human(res: dict[str, Any]) -> None:
    for k, v in res.items():
        print(f"{k:>34}: {v}")


def bench_command(args) -> int:
    """Entry point of ``hf_sparsity bench``."""
    from ..loading import resolve_dtype
    from . import _checks

    _checks.bench_args(args)  # one-line errors for bad input
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype, flag="--dtype")
    options = {}
    if args.kernel:
        options["kernel"] = args.kernel
    # what libraries print while the model loads (DeepSpeed, imported by transformers when installed, prints
    # "Setting accelerator to CPU" on stdout) goes to stderr: stdout carries the result, e.g. the JSON
    with contextlib.redirect_stdout(sys.stderr):
        res = _run(args, dtype, options)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        _print_human(res)
    return 0


def _run(args, dtype, options) -> dict:
    from ..inference.bench import bench_layer, bench_model, parse_shape

    if args.model:
        return bench_model(
            args.model,
            backend=args.backend,
            masks=args.masks,
            sparsity=args.sparsity,
            new_tokens=args.new_tokens,
            prompt_len=args.prompt_len,
            rounds=args.rounds,
            dtype=dtype if args.dtype != "float32" else None,  # float32 (the default): as saved
            seed=args.seed,
            **options,
        )
    if args.batch < 1:
        raise SparsityError("--batch must be at least 1.")
    return bench_layer(
        args.backend,
        sparsity=0.9 if args.sparsity is None else args.sparsity,
        shape=parse_shape(args.shape),
        batch=args.batch,
        dtype=dtype,
        device=args.device,
        init=args.init,
        structure=args.structure,
        repeats=args.repeats,
        seed=args.seed,
        **options,
    )


def bench_command_parser(subparsers):
    """Register ``hf_sparsity bench``."""
    p = subparsers.add_parser(
        "bench",
        help="Time a sparse backend against dense (one layer, or whole-model decoding with --model).",
        description=__doc__,
        formatter_class=__import__("argparse").RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--backend",
        default="csr",
        help="csr (default), auto, bitmask, nm24, native_dense, masked_dense, semi_structured, emulator",
    )
    p.add_argument(
        "--sparsity", type=float, default=None, help="Level for the layer (default 0.9) or model masks"
    )
    p.add_argument("--shape", default="768x3072", help="Layer shape OUTxIN (default 768x3072)")
    p.add_argument("--batch", type=int, default=1, help="Rows of the input (default 1: decoding)")
    p.add_argument("--dtype", default="float32", help="float32 (default), float64, float16, bfloat16")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--init", default="random", choices=["random", "topk"], help="Mask type for the layer")
    p.add_argument("--structure", default=None, help="N:M mask structure, e.g. 2:4 (semi_structured uses it)")
    p.add_argument("--kernel", default=None, help="csr kernel: auto (default), native, torch")
    p.add_argument("--threads", type=int, default=None, help="torch / native kernel threads")
    p.add_argument("--repeats", type=int, default=30, help="Interleaved timing rounds for a layer")
    p.add_argument("--model", default=None, help="A model folder: bench whole-model greedy decoding")
    p.add_argument("--masks", default=None, help="With --model: a mask file/folder, or 'zeros'")
    p.add_argument("--new-tokens", type=int, default=32, help="Tokens generated per round (--model)")
    p.add_argument("--prompt-len", type=int, default=16, help="Prompt length (--model)")
    p.add_argument("--rounds", type=int, default=3, help="Interleaved dense/backend rounds (--model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="Print one JSON object")
    p.set_defaults(func=bench_command)
    return p
