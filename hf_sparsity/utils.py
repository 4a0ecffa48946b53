"""Small helpers with no dependency on the rest of the package: atomic writes, logging, versions."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import torch


class SparsityError(ValueError):
    """Raised for bad user input; the message names the problem and the fix."""


__version__ = "0.1.0"  # the package root re-exports it; keep equal to pyproject.toml


def library_version() -> str:
    try:
        return version("hf_sparsity")
    except Exception:  # running from a source tree that was never installed
        return __version__


def _disk_full(e: BaseException) -> bool:
    """A write failed for lack of space: an ``OSError`` with ENOSPC / EDQUOT, or a writer's own error
    carrying it (safetensors raises ``SafetensorError(... No space left on device (os error 28))``)."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(e)
    return any(s in text for s in (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT)))


def _disk_full_error(path: Path) -> SparsityError:
    return SparsityError(
        f"{os.strerror(errno.ENOSPC)} writing {str(path)!r}; nothing was written there. Free some space "
        "or write to another disk."
    )


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """Yield a temporary path in the same folder; rename it onto ``path`` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield tmp
        # mkstemp makes 0600, and so do writers that replace the file (safetensors' save_file):
        # give the file what open() would.
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except Exception as e:
        if _disk_full(e):
            raise _disk_full_error(path) from None
        raise
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)


def _umask() -> int:
    """The process umask (read without changing it where the system allows)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _apply_umask(folder: Path) -> None:
    """Give ``folder`` and everything in it the modes mkdir / open() would: ``mkdtemp`` makes 0700
    and safetensors' ``save_file`` 0600, whatever the umask."""
    mask = _umask()
    os.chmod(folder, 0o777 & ~mask)
    for root, dirs, files in os.walk(folder):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o777 & ~mask)
        for f in files:
            os.chmod(os.path.join(root, f), 0o666 & ~mask)


def check_out_dir(
    model_dir: str | os.PathLike | None, out_dir: str | os.PathLike, overwrite: bool = False
) -> None:
    """Refuse an output folder equal to, inside, or (with ``overwrite``) holding the input folder,
    and an existing one without ``overwrite``."""
    out = Path(out_dir).resolve()
    if model_dir is not None:
        src = Path(model_dir).resolve()
        if out == src or src in out.parents:
            where = "is" if out == src else "is inside"
            raise SparsityError(
                f"Output folder {str(out_dir)!r} {where} the model folder {str(model_dir)!r}; "
                "write the output to a folder outside it."
            )
        if overwrite and out in src.parents:
            raise SparsityError(
                f"Output folder {str(out_dir)!r} holds the model folder {str(model_dir)!r}, which "
                "--overwrite would delete; write the output to a folder outside it."
            )
    if out.exists() and not overwrite:
        raise SparsityError(
            f"Output folder {str(out_dir)!r} already exists. Choose another path or pass --overwrite to "
            "replace it."
        )


@contextlib.contextmanager
def atomic_dir(
    path: str | os.PathLike, overwrite: bool = False, source: str | os.PathLike | None = None
) -> Iterator[Path]:
    """Build a folder under a temporary name beside ``path`` and rename it into place at the end.

    Refuses an existing ``path`` unless ``overwrite``, and a ``path`` equal to, inside or holding
    ``source`` (the folder being read; see :func:`check_out_dir`); on failure nothing at ``path``
    changes. The folder gets the user's umask, like one ``save_pretrained`` makes.
    """
    path = Path(path)
    check_out_dir(source, path, overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        _apply_umask(tmp)
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except Exception as e:
        if _disk_full(e):
            raise _disk_full_error(path) from None
        raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``n`` inside the block, and restored after it."""
    old = torch.get_num_threads()
    if n != old:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n != old:
            torch.set_num_threads(old)
