"""Value checks shared by the config, the schedules and the entry points: sparsity levels, N:M
structure strings, LoRA modes, positive numbers, paths that must exist.

A leaf module (it imports only :mod:`hf_sparsity.utils`), so ``config`` and ``schedules``
can both use it without importing each other.
"""

from __future__ import annotations

import glob
import math
import os
import re
from typing import Any

from .utils import SparsityError


def check_level(value: Any, key: str = "sparsity") -> float:
    """A sparsity level must be a number in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SparsityError(f"`{key}` must be a number in [0, 1), got {value!r}. Example: {key}: 0.75")
    value = float(value)
    if not (0.0 <= value < 1.0) or math.isnan(value):
        raise SparsityError(
            f"`{key}` = {value} is outside [0, 1). Use a fraction of weights to zero, e.g. 0.75 for 75% "
            "sparsity "
            "(1.0 would remove every weight)."
        )
    return value


def check_structure(value: Any) -> tuple[int, int] | None:
    """``"n:m"`` -> (n, m): keep n of every m consecutive weights along the input dimension."""
    if value is None:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", str(value))
    if not m or not (0 < int(m.group(1)) <= int(m.group(2))):
        raise SparsityError(
            f'`structure` = {value!r} is not an N:M pattern. Use e.g. "2:4" (keep 2 of every 4).'
        )
    return int(m.group(1)), int(m.group(2))


LORA_MODES = ("masked", "merge_then_mask")


def check_lora_mode(value: Any) -> str | None:
    """The ``lora`` setting of a sparsity config: ``None``, ``masked`` or ``merge_then_mask``."""
    if value is None or value in LORA_MODES:
        return value
    raise SparsityError(
        f"`lora` = {value!r} is not a LoRA mode. Use `masked` (adapter update applied as (B·A) ⊙ M, "
        "merges exactly) or `merge_then_mask` (plain adapter, mask re-applied when merging)."
    )


def check_positive(value: int | float | None, flag: str) -> None:
    """``value`` is ``None`` (default) or above zero."""
    if value is not None and value <= 0:
        raise SparsityError(f"{flag} must be a positive number, got {value}.")


def check_paths_exist(paths: str | list[str] | None, flag: str) -> None:
    """Every named file / folder / glob matches something."""
    for p in [paths] if isinstance(paths, str) else paths or []:
        if not (os.path.exists(p) or glob.glob(p)):
            raise SparsityError(
                f"{flag} {p!r} does not exist. Check the path (data files are not downloaded)."
            )
