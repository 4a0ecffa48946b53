"""``hf_sparsity convert``: finalize a sparse checkpoint, or move to/from Cerebras NaN sentinels."""

# Lazy imports: a subcommand imports the library when it runs, so `--help` and the others start fast.

from __future__ import annotations


def convert_command_parser(subparsers):
    p = subparsers.add_parser(
        "convert",
        help="finalize masks into a vanilla checkpoint, or convert to/from NaN-sentinel checkpoints",
        description="All conversions stream shard by shard and write OUT atomically; OUT must not exist "
        "unless --overwrite.",
    )
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--finalize", action="store_true", help="bake masks into zeros; drop mask file + config section"
    )
    mode.add_argument(
        "--to-sentinel", action="store_true", help="masked weights -> NaN (Cerebras in-band format)"
    )
    mode.add_argument("--from-sentinel", action="store_true", help="NaN weights -> 0 plus a mask file")
    p.add_argument("input", metavar="IN", help="model folder")
    p.add_argument("output", metavar="OUT", help="new model folder")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.add_argument(
        "--results", metavar="JSON", help="--finalize: `hf_sparsity eval` results for the model card"
    )
    p.add_argument("--no-model-card", action="store_true", help="--finalize: write no README.md model card")
    p.set_defaults(func=convert_command)


def convert_command(args) -> int:
    from ..export.finalize import finalize_checkpoint, from_sentinel, to_sentinel
    from . import _checks

    _checks.model_dir(args.input, "IN")
    fn = finalize_checkpoint if args.finalize else to_sentinel if args.to_sentinel else from_sentinel
    card = {"model_card": not args.no_model_card, "results": args.results} if args.finalize else {}
    out = fn(args.input, args.output, overwrite=args.overwrite, **card)
    print(f"wrote {out}")
    return 0
