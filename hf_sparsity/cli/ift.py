"""``hf_sparsity ift``: Sparse-IFT transform of a model config (Sparse-Wide, -Parallel, -Factorized, -Doped).

Each projection / FFN layer is enlarged and made sparse so its FLOPs equal the dense
original's; the command prints per-layer and whole-model FLOPs, original vs
transformed, and explains the difference (embeddings, attention and the LM head
are not transformed). With ``--out`` it writes the new ``config.json`` (carrying the
per-layer sparsity levels for ``SparsityCallback``) and, when the architecture
changes, ``modeling_sparse_ift.py`` for ``trust_remote_code=True``.

Examples::

    hf_sparsity ift --config gpt3-small/config.json --sparsity 0.5 --transform wide --out out/wide50
    hf_sparsity ift --config gpt3-small/config.json --sparsity 0.75 --transform factorized --json
"""

# Lazy imports: a subcommand imports the library when it runs, so `--help` and the others start fast.

from __future__ import annotations

import argparse
import json


def ift_command_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``ift`` on the ``hf_sparsity`` command line."""
    from ..ift import TRANSFORMS

    p = subparsers.add_parser(
        "ift",
        help="Sparse-IFT: an iso-FLOP wider / parallel / factorized / doped sparse config",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True, help="the dense model's config.json path or model directory")
    p.add_argument("--sparsity", type=float, required=True, help="sparsity level s in [0, 1)")
    p.add_argument("--transform", required=True, choices=TRANSFORMS, help="Sparse-IFT family member")
    p.add_argument("--out", help="write the transformed config (and model code) to this new folder")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--seq-len", type=int, help="sequence length for attention FLOPs (default: the config's)")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.set_defaults(func=ift_command)
    return p


def ift_command(args) -> int:
    from ..ift import sparse_ift
    from ..utils import SparsityError
    from . import _checks

    _checks.model_config(args.config)
    if args.seq_len is not None and args.seq_len <= 0:
        raise SparsityError(f"--seq-len must be a positive integer, got {args.seq_len}.")
    result = sparse_ift(args.config, args.sparsity, args.transform, seq_len=args.seq_len)
    if args.out:
        result.save(args.out, overwrite=args.overwrite)
    if args.json:
        out = result.to_dict()
        if args.out:
            out["out"] = args.out
        print(json.dumps(out, indent=2))
    else:
        print(result.format())
        if args.out:
            code = result.model_code()
            how = (
                "AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(DIR), trust_remote_code=True)"
                if code
                else "AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(DIR))"
            )
            print(
                f"\nwrote {args.out}: build with {how}; train with "
                "SparsityCallback(get_sparsity_config(config))."
            )
    return 0
