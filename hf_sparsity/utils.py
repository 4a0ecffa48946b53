"""Small helpers with no dependency on the rest of the package: atomic writes, logging, versions."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


class SparsityError(ValueError):
    """Raised for bad user input; the message names the problem and the fix."""


__version__ = "0.1.0"  # the package root re-exports it; keep equal to pyproject.toml


def library_version() -> str:
    try:
        from importlib.metadata import version

        return version("hf_sparsity")
    except Exception:  # running from a source tree that was never installed
        return __version__


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """Yield a temporary path in the same folder; rename it onto ``path`` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Build a folder under a temporary name beside ``path`` and rename it into place at the end.

    Refuses an existing ``path`` unless ``overwrite``; on failure nothing at ``path`` changes.
    """
    path = Path(path)
    if path.exists() and not overwrite:
        raise SparsityError(
            f"Output folder {str(path)!r} already exists. Choose another path or pass --overwrite to "
            "replace it."
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
