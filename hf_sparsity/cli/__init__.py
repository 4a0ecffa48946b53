"""``hf_sparsity`` command line. One module per subcommand, accelerate-style.

Each module ``hf_sparsity/cli/<name>.py`` exposes ``<name>_command_parser(subparsers)``
(adds its sub-parser and sets ``func``) and is listed in :data:`COMMANDS` below, explicitly,
as accelerate does: a command missing from the list, or registered twice, is an error a
test sees (``tests/test_cli.py``), never a silently dropped subcommand.
"""

from __future__ import annotations

import argparse
import logging
import sys

from ..utils import SparsityError
from .bench import bench_command_parser
from .convert import convert_command_parser
from .eval import eval_command_parser
from .flops import flops_command_parser
from .generate import generate_command_parser
from .ift import ift_command_parser
from .inspect import inspect_command_parser
from .prune import prune_command_parser
from .validate import validate_command_parser

# Every subcommand, in help order. Add a new one here (and in tests/test_cli.py's expected list).
COMMANDS = (
    bench_command_parser,
    convert_command_parser,
    eval_command_parser,
    flops_command_parser,
    generate_command_parser,
    ift_command_parser,
    inspect_command_parser,
    prune_command_parser,
    validate_command_parser,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf_sparsity", description="Train, prune, convert and evaluate sparse HF language models."
    )
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default) or ERROR")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for register in COMMANDS:
        before = set(sub.choices)
        register(sub)
        added = set(sub.choices) - before
        if not added:
            raise RuntimeError(f"{register.__name__} registered no subcommand (or one that already exists).")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.WARNING), format="%(message)s"
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except SparsityError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
