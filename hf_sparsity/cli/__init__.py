"""``hf_sparsity`` command line. One module per subcommand, accelerate-style.

Each module ``hf_sparsity/cli/<name>.py`` exposes ``<name>_command_parser(subparsers)``
(adds its sub-parser and sets ``func``); modules are discovered automatically.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys

from ..utils import SparsityError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf_sparsity", description="Train, prune, convert and evaluate sparse HF language models."
    )
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default) or ERROR")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        register = getattr(module, f"{info.name}_command_parser", None)
        if register is not None:
            register(sub)
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
