"""Processes that start with their libraries imported: each run a process of its own, forked from one server
(``multiprocessing``'s forkserver) that imported the modules once, instead of a fresh interpreter that pays
torch's, transformers' and the Trainer's imports (seconds) again. For tests that start many short runs of
one script and kill some of them.

A run is a real process: its own memory, its own exit status (``-9`` when SIGKILLed), everything it prints
in a log file; it shares nothing with the test but the modules imported before the fork.
"""

from __future__ import annotations

import importlib
import multiprocessing
import multiprocessing.forkserver
import os
import signal
from pathlib import Path


def _child(module: str, function: str, args: tuple, log: str, env: dict[str, str]) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    getattr(importlib.import_module(module), function)(*args)


class Server:
    """``start(log, *args)`` runs ``module.function(*args)`` in a process forked from a server that has
    ``module`` (and so everything it imports) loaded; ``env`` is set in each run before the call."""

    def __init__(self, module: str, function: str = "main", env: dict[str, str] | None = None):
        self.module, self.function, self.env = module, function, dict(env or {})
        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload([module])

    def start(self, log: Path, *args) -> multiprocessing.Process:
        proc = self.ctx.Process(target=_child, args=(self.module, self.function, args, str(log), self.env))
        proc.start()
        return proc

    def close(self) -> None:
        """Stop the server (it holds the imported libraries' memory): killed, as it has nothing to save and
        its interpreter's exit with torch loaded takes seconds, then reaped (the stdlib's own test hook)."""
        server = multiprocessing.forkserver._forkserver
        if getattr(server, "_forkserver_pid", None) is not None:
            os.kill(server._forkserver_pid, signal.SIGKILL)
        stop = getattr(server, "_stop", None)
        if stop is not None:
            stop()
