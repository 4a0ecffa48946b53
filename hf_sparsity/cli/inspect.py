"""``hf_sparsity inspect DIR``: per-layer sparsity of a model folder."""

# Lazy imports: a subcommand imports the library when it runs, so `--help` and the others start fast.

from __future__ import annotations

import json


def inspect_command_parser(subparsers):
    p = subparsers.add_parser("inspect", help="per-layer shape, level and nonzeros of a model folder")
    p.add_argument("model_dir", metavar="DIR")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=inspect_command)


def inspect_command(args) -> int:
    from ..storage.folders import format_inspection, inspect_checkpoint
    from . import _checks

    _checks.model_dir(args.model_dir, "DIR")
    report = inspect_checkpoint(args.model_dir)
    print(json.dumps(report, indent=2) if args.json else format_inspection(report))
    return 0
