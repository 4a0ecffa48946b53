"""The command line registers every subcommand explicitly, once."""

import pkgutil

import pytest

import hf_sparsity.cli as cli_pkg
from hf_sparsity.cli import COMMANDS, build_parser

EXPECTED = {"bench", "convert", "eval", "flops", "generate", "ift", "inspect", "prune", "validate"}


def _subcommands(parser):
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    return set(sub.choices)


def test_every_subcommand_is_registered():
    assert EXPECTED <= _subcommands(build_parser())


def test_every_command_module_is_in_the_list():
    modules = {i.name for i in pkgutil.iter_modules(cli_pkg.__path__) if not i.name.startswith("_")}
    listed = {f.__module__.rpartition(".")[2] for f in COMMANDS}
    assert modules == listed, f"modules not in COMMANDS: {sorted(modules - listed)}"


def test_a_register_function_that_adds_nothing_is_an_error(monkeypatch):
    monkeypatch.setattr(cli_pkg, "COMMANDS", (*COMMANDS, lambda sub: None))
    with pytest.raises(RuntimeError, match="registered no subcommand"):
        build_parser()
