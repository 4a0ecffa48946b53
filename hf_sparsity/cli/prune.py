"""``hf_sparsity prune``: one-shot prune a pretrained model folder into a sparse model folder.

Examples::

    hf_sparsity prune models/dense out/wanda50 --method wanda --sparsity 0.5 \\
        --calib-data DATA_DIR/corpus/openwebtext-1000.jsonl --nsamples 32 --seqlen 512
    hf_sparsity prune models/dense out/sgpt24 --method sparsegpt --structure 2:4 --calib-data c4.jsonl \\
        --refit --reconstruct
    hf_sparsity prune models/dense out/fast2x --method sparsegpt --target-speedup 2 --values int8 \\
        --calib-data c4.jsonl --threads 2

Every input is checked by the library (``prune_folder``); this module only parses.
"""

# Lazy imports: a subcommand imports the library when it runs, so `--help` and the others start fast.

from __future__ import annotations

import argparse
import sys
import time

from ..pruning.reconstruct import DEFAULT_LR, DEFAULT_STEPS
from ..pruning.spdy_search import DEFAULT_SEARCH_MOVES, DEFAULT_SEARCH_STEPS, DEFAULT_SEARCH_WINDOWS


def prune_command_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``prune`` on the ``hf_sparsity`` command line."""
    p = subparsers.add_parser(
        "prune",
        help="one-shot prune a pretrained model (magnitude, Wanda, SparseGPT; unstructured or N:M)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model_dir", metavar="MODEL_DIR", help="pretrained model folder (with tokenizer)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="new sparse model folder (written atomically)")
    p.add_argument(
        "--method", choices=["magnitude", "wanda", "sparsegpt"], default="wanda", help="default wanda"
    )
    p.add_argument("--sparsity", type=float, help="level of every targeted tensor (default 0.5)")
    p.add_argument("--structure", help='N:M structure, e.g. "2:4" (keep 2 of every 4 along the input)')
    p.add_argument("--config", help="params YAML with a `sparsity:` section (targets, per-pattern levels)")
    p.add_argument(
        "--calib-data", help="calibration .jsonl (one document per row), .txt (blank-line paragraphs) or name"
    )
    p.add_argument("--text-column", default="text", help="JSONL / dataset text field (default text)")
    p.add_argument("--nsamples", type=int, default=128, help="calibration windows (default 128)")
    p.add_argument("--seqlen", type=int, default=2048, help="tokens per window (default 2048)")
    p.add_argument("--seed", type=int, default=0, help="calibration sampling seed (default 0)")
    p.add_argument("--device", help="where each block runs: cpu (default) or cuda")
    p.add_argument("--batch-size", type=int, default=8, help="calibration windows per block forward")
    p.add_argument("--blocksize", type=int, default=128, help="SparseGPT lazy-batch width (default 128)")
    p.add_argument("--percdamp", type=float, default=0.01, help="SparseGPT damping (default 0.01)")
    p.add_argument("--owl", action="store_true", help="OWL non-uniform block levels (global level exact)")
    p.add_argument("--owl-lambda", type=float, default=0.08, help="OWL's largest level shift (default 0.08)")
    p.add_argument(
        "--refit", action="store_true", help="after the mask is chosen, solve for the kept weights exactly"
    )
    p.add_argument(
        "--reconstruct",
        action="store_true",
        help="train each pruned block's kept weights to match the dense one",
    )
    p.add_argument(
        "--reconstruct-steps",
        type=int,
        help=f"Adam steps per block for --reconstruct (default {DEFAULT_STEPS})",
    )
    p.add_argument("--reconstruct-lr", type=float, default=DEFAULT_LR, help=f"default {DEFAULT_LR}")
    _speed_options(p)
    p.add_argument("--masks", help="use this mask file (or model folder's masks) instead of choosing masks")
    p.add_argument(
        "--no-streaming", action="store_true", help="load the whole model instead of one block at a time"
    )
    p.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=prune_command)
    return p


def _speed_options(p: argparse.ArgumentParser) -> None:
    """``--target-speedup`` and the options that go with it."""
    p.add_argument(
        "--target-speedup",
        type=float,
        metavar="S",
        help="choose each layer's level for a decoding speed-up of S over the dense model on this machine "
        "(SPDY: measured time table, per-layer errors, dynamic program, search on the calibration loss); "
        "needs --method sparsegpt or wanda",
    )
    p.add_argument(
        "--values",
        choices=["float32", "int8"],
        help="--target-speedup: the value type both models decode with (default float32)",
    )
    p.add_argument(
        "--spdy-levels",
        metavar="L1,L2,...",
        help="--target-speedup: the candidate levels, each in [0, 1) (default 0,0.1,...,0.8)",
    )
    p.add_argument("--threads", type=int, help="--target-speedup: threads for the timings (default torch's)")
    p.add_argument(
        "--spdy-search-steps",
        type=int,
        default=DEFAULT_SEARCH_STEPS,
        help="--target-speedup: steps of SPDY's search for per-layer error weights scored on the calibration "
        f"loss (0: the plain program; default {DEFAULT_SEARCH_STEPS})",
    )
    p.add_argument(
        "--spdy-search-moves",
        type=int,
        default=DEFAULT_SEARCH_MOVES,
        help="--target-speedup: after the search's steps, moves of one layer a level denser paid for by "
        f"others a level sparser, each kept when the calibration loss falls (default {DEFAULT_SEARCH_MOVES})",
    )
    p.add_argument(
        "--spdy-search-windows",
        type=int,
        default=DEFAULT_SEARCH_WINDOWS,
        help="--target-speedup: calibration windows that score each candidate "
        f"(default {DEFAULT_SEARCH_WINDOWS})",
    )
    p.add_argument(
        "--measure-rounds",
        type=int,
        default=5,
        help="--target-speedup: interleaved decoding rounds for the measured speed-up (0: skip; default 5)",
    )


def prune_command(args: argparse.Namespace) -> int:
    """Run ``hf_sparsity prune``; returns the exit status."""
    from ..pruning.pipeline import prune_folder

    if args.no_progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # transformers' "Loading weights" bar too
    t0 = time.perf_counter()
    result = prune_folder(
        args.model_dir,
        args.out_dir,
        method=args.method,
        sparsity=args.sparsity,
        structure=args.structure,
        config_path=args.config,
        calib_data=args.calib_data,
        text_column=args.text_column,
        nsamples=args.nsamples,
        seqlen=args.seqlen,
        seed=args.seed,
        device=args.device,
        batch_size=args.batch_size,
        blocksize=args.blocksize,
        percdamp=args.percdamp,
        owl_lambda=args.owl_lambda if args.owl else None,
        overwrite=args.overwrite,
        progress=not args.no_progress and sys.stderr.isatty(),
        refit=args.refit,
        reconstruct_steps=_steps(args),
        reconstruct_lr=args.reconstruct_lr,
        masks=args.masks,
        streaming=not args.no_streaming,
        target_speedup=args.target_speedup,
        values=args.values,
        spdy_levels=args.spdy_levels,
        threads=args.threads,
        measure_rounds=args.measure_rounds,
        spdy_search_steps=args.spdy_search_steps,
        spdy_search_windows=args.spdy_search_windows,
        spdy_search_moves=args.spdy_search_moves,
    )
    print(result.summary())
    print(f"wrote {args.out_dir} in {time.perf_counter() - t0:.1f} s (prune {result.seconds:.1f} s)")
    return 0


def _steps(args: argparse.Namespace) -> int | None:
    """``--reconstruct-steps N`` alone also turns reconstruction on; the library checks N."""
    if args.reconstruct_steps is not None:
        return args.reconstruct_steps
    return DEFAULT_STEPS if args.reconstruct else None
